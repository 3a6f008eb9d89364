/* What the C light rank's files share (bench/light_rank.c, light_relay.c, light_io.c). */
#ifndef LIGHT_RANK_H
#define LIGHT_RANK_H

#include <stddef.h>
#include <sys/types.h>

/* elastic/codes.py */
enum { EXIT_DONE = 0, EXIT_FAILED = 1, EXIT_CHECKPOINTED = 75, EXIT_BAD_INPUT = 78 };

/* -- bytes, JSON, files (light_io.c) -- */
struct buf {
    char *p;
    size_t len, cap;
};

void buf_add(struct buf *b, const char *s, size_t n);
void buf_str(struct buf *b, const char *s);
__attribute__((format(printf, 2, 3))) void buf_fmt(struct buf *b, const char *fmt, ...);
void buf_reset(struct buf *b);
char *join(const char *dir, const char *name);
unsigned next_char(const char *s, size_t *i);
char *head(const char *s, size_t chars);
void json_str(struct buf *b, const char *s);
void put_float(struct buf *b, double v, int msgspec);
void put_repr(struct buf *b, const char *s);

extern char oserr[1200];
/* The failure of the last call, as Python's OSError says it. */
int os_fail(const char *what);
double now_s(void);
double mono_s(void);
void sleep_s(double s);
int write_all(int fd, const char *data, size_t len);
int write_atomic(int dir_fd, const char *path, const char *data, size_t len, int durable);
int makedirs(const char *path, mode_t mode);
int is_digits(const char *s, size_t n);
int starts(const char *s, const char *prefix);
int ends(const char *s, const char *suffix);
char *safe(const char *text, size_t limit);

/* -- the node's aggregation (light_relay.c) -- */
struct relay {
    int fd;
    char *path, *node, *shared;
    char name[48];
    double interval;
    int lock_fd, leader, lock_gen;   /* lock_gen: the generation lock_fd is open on */
    long takeovers;
    double next_publish, published_at;
    int lines_fd, metrics_fd, out_fd;
    char lines_name[96];
    double lines_due;
    int beat_here;   /* this rank's beat is in the folder: removed after it, the job's end did */
};

struct relay *relay_open(const char *base, const char *job_id, const char *node, long long rank,
                         const char *shared, double interval);
int relay_lead(struct relay *r, double now);
int relay_beat(struct relay *r, const char *data, size_t len, double now, int last, double *published);
int relay_open_lines(struct relay *r, const char *metrics_dir, long long rank, int own);
void relay_close_lines(struct relay *r, int own_fd);

#endif
