/* Parsing of the plugin's arguments and option values. No Slurm calls here: the tests build
 * this file alone (tests/spank/harness.c). Every function returns 0 or -1 and, on -1, leaves one
 * line in err naming the value and what is allowed. */
#ifndef OMNI_SPANK_ARGS_H
#define OMNI_SPANK_ARGS_H

#include <limits.h>
#include <stddef.h>

#define OMNI_MAX_STAGES 16
#define OMNI_NAME_MAX 64
#define OMNI_ERR_MAX 256

struct omni_stage {
	char name[OMNI_NAME_MAX];
	long ntasks; /* -1: not given */
};

struct omni_stage_list {
	int count;
	struct omni_stage stages[OMNI_MAX_STAGES];
};

struct omni_config {
	char spool[PATH_MAX]; /* empty: no fault records */
	char memory_dir[PATH_MAX]; /* the site's checkpoint memory_dir (%n: the node), cleaned beside /dev/shm; empty: none */
};

/* Which stage a task belongs to, and its rank and size inside the stage. */
struct omni_placement {
	int stage;
	long stage_rank;
	long stage_size;
};

int omni_parse_config(int ac, char **av, struct omni_config *cfg, char *err, size_t errlen);
int omni_parse_stages(const char *arg, struct omni_stage_list *out, char *err, size_t errlen);
int omni_check_path(const char *what, const char *arg, char *err, size_t errlen);
int omni_parse_long(const char *text, long min, long max, long *out);

/* Leaves one formatted line in err (if err is non-NULL and errlen > 0); shared with fault.c. */
void omni_set_err(char *err, size_t errlen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* het_offset >= 0: a heterogeneous step, component het_offset, the task is comp_rank of
 * comp_size there. het_offset < 0: an ordinary step; stages split the global ranks in order. */
int omni_place(const struct omni_stage_list *stages, long het_offset, long comp_rank, long comp_size,
	       long global_rank, long global_size, struct omni_placement *out, char *err, size_t errlen);

#endif
