/* The C light rank's bytes, JSON and files (bench/light_rank.c): what json, msgspec and
 * slurm_omni.fsio do for bench/light_rank.py. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "light_rank.h"

/* -- bytes ------------------------------------------------------------------------------------ */
void buf_add(struct buf *b, const char *s, size_t n)
{
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            fputs("light rank: out of memory\n", stderr);
            _exit(EXIT_FAILED);
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

void buf_str(struct buf *b, const char *s) { buf_add(b, s, strlen(s)); }

__attribute__((format(printf, 2, 3))) void buf_fmt(struct buf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof tmp) {
        char *big = malloc((size_t)n + 1);
        if (!big)
            _exit(EXIT_FAILED);
        va_start(ap, fmt);
        vsnprintf(big, (size_t)n + 1, fmt, ap);
        va_end(ap);
        buf_add(b, big, (size_t)n);
        free(big);
    } else if (n > 0) {
        buf_add(b, tmp, (size_t)n);
    }
}

void buf_reset(struct buf *b) { b->len = 0; if (b->p) b->p[0] = 0; }

char *join(const char *dir, const char *name)   /* os.path.join of two */
{
    struct buf b = {0};
    if (name[0] == '/' || !dir[0]) {
        buf_str(&b, name);
    } else {
        buf_str(&b, dir);
        if (dir[strlen(dir) - 1] != '/')
            buf_str(&b, "/");
        buf_str(&b, name);
    }
    return b.p;
}

/* One character of a string as Python reads the environment (UTF-8, surrogateescape): its code
 * point, *i moved past it; an undecodable byte is one character, U+DC80..U+DCFF. */
unsigned next_char(const char *s, size_t *i)
{
    const unsigned char *u = (const unsigned char *)s + *i;
    unsigned c = u[0];
    int n = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 0;
    if (n == 1) {
        *i += 1;
        return c;
    }
    unsigned cp = n == 2 ? c & 0x1f : n == 3 ? c & 0x0f : c & 0x07;
    for (int k = 1; k < n; k++) {
        if ((u[k] & 0xc0) != 0x80) {
            n = 0;
            break;
        }
        cp = cp << 6 | (u[k] & 0x3f);
    }
    if (n == 0 || (n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff))
        || (cp >= 0xd800 && cp <= 0xdfff)) {
        *i += 1;
        return 0xdc00 + c;
    }
    *i += (size_t)n;
    return cp;
}

/* The first `chars` characters of s (a new string). */
char *head(const char *s, size_t chars)
{
    size_t i = 0;
    for (size_t k = 0; s[i] && k < chars; k++)
        next_char(s, &i);
    return strndup(s, i);
}

/* -- JSON as json.dumps(separators=(",", ":")) and msgspec write it ------------------------------- */
void json_str(struct buf *b, const char *s)   /* _json.encode_basestring_ascii */
{
    buf_str(b, "\"");
    for (size_t i = 0; s[i];) {
        unsigned c = next_char(s, &i);
        switch (c) {
        case '"': buf_str(b, "\\\""); break;
        case '\\': buf_str(b, "\\\\"); break;
        case '\n': buf_str(b, "\\n"); break;
        case '\r': buf_str(b, "\\r"); break;
        case '\t': buf_str(b, "\\t"); break;
        case '\b': buf_str(b, "\\b"); break;
        case '\f': buf_str(b, "\\f"); break;
        default:
            if (c >= 0x20 && c < 0x7f) {
                char ch = (char)c;
                buf_add(b, &ch, 1);
            } else if (c > 0xffff) {
                c -= 0x10000;
                buf_fmt(b, "\\u%04x\\u%04x", 0xd800 | (c >> 10), 0xdc00 | (c & 0x3ff));
            } else {
                buf_fmt(b, "\\u%04x", c);
            }
        }
    }
    buf_str(b, "\"");
}

/* The shortest digits that read back as v (> 0, finite), as repr finds them: "d1d2..." and the
 * decimal exponent of d1. */
static int shortest(double v, char *digits, int *exp10)
{
    char tmp[40];
    for (int p = 1; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, v);
        if (strtod(tmp, NULL) == v)
            break;
    }
    int n = 0;
    const char *t = tmp;
    for (; *t && *t != 'e'; t++)
        if (*t >= '0' && *t <= '9')
            digits[n++] = *t;
    while (n > 1 && digits[n - 1] == '0')
        n--;
    digits[n] = 0;
    *exp10 = atoi(t + 1);
    return n;
}

/* repr(v) (msgspec = 0), or as msgspec writes it (msgspec = 1: 1.5e-05 as 0.000015, 1e+16 as 1e16). */
void put_float(struct buf *b, double v, int msgspec)
{
    if (!isfinite(v)) {   /* never a time or a duration; json would refuse it */
        buf_str(b, msgspec ? "null" : isnan(v) ? "nan" : v > 0 ? "inf" : "-inf");
        return;
    }
    if (signbit(v))
        buf_str(b, "-");
    v = fabs(v);
    if (v == 0) {
        buf_str(b, "0.0");
        return;
    }
    char d[24];
    int x, n = shortest(v, d, &x);
    if (x >= (msgspec ? -5 : -4) && x < 16) {
        if (x >= 0) {
            if (n <= x + 1) {
                buf_add(b, d, (size_t)n);
                for (int k = n; k < x + 1; k++)
                    buf_str(b, "0");
                buf_str(b, ".0");
            } else {
                buf_add(b, d, (size_t)x + 1);
                buf_str(b, ".");
                buf_str(b, d + x + 1);
            }
        } else {
            buf_str(b, "0.");
            for (int k = 0; k < -x - 1; k++)
                buf_str(b, "0");
            buf_str(b, d);
        }
        return;
    }
    buf_add(b, d, 1);
    if (n > 1) {
        buf_str(b, ".");
        buf_str(b, d + 1);
    }
    if (msgspec)
        buf_fmt(b, "e%d", x);
    else
        buf_fmt(b, "e%c%02d", x < 0 ? '-' : '+', abs(x));
}

/* repr() of a string, as a message quotes a bad value. */
void put_repr(struct buf *b, const char *s)
{
    char q = strchr(s, '\'') && !strchr(s, '"') ? '"' : '\'';
    buf_add(b, &q, 1);
    for (size_t i = 0; s[i];) {
        size_t at = i;
        unsigned c = next_char(s, &i);
        if (c == (unsigned char)q || c == '\\')
            buf_fmt(b, "\\%c", (char)c);
        else if (c == '\n')
            buf_str(b, "\\n");
        else if (c == '\r')
            buf_str(b, "\\r");
        else if (c == '\t')
            buf_str(b, "\\t");
        else if (c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0) || (c >= 0xdc80 && c <= 0xdcff))
            buf_fmt(b, c <= 0xff ? "\\x%02x" : "\\u%04x", c);
        else
            buf_add(b, s + at, i - at);
    }
    buf_add(b, &q, 1);
}

/* -- files -------------------------------------------------------------------------------------- */
char oserr[1200];
/* The failure of the last call, as Python's OSError says it. */
int os_fail(const char *what)
{
    int e = errno;
    snprintf(oserr, sizeof oserr, "[Errno %d] %s: '%s'", e, strerror(e), what);
    errno = e;
    return -1;
}

double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

double mono_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void sleep_s(double s)   /* a signal ends it early: the callers loop on the clock */
{
    if (s <= 0)
        return;
    struct timespec t = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&t, NULL);
}

int write_all(int fd, const char *data, size_t len)
{
    while (len) {
        ssize_t n = write(fd, data, len);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        data += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Like slurm_omni.fsio.write_atomic: a temporary name in the same folder (dir_fd: an open one, or
 * AT_FDCWD), then a rename. */
int write_atomic(int dir_fd, const char *path, const char *data, size_t len, int durable)
{
    const char *slash = strrchr(path, '/');
    struct buf tmp = {0};
    if (slash)
        buf_add(&tmp, path, (size_t)(slash - path) + 1);
    buf_fmt(&tmp, ".%s.%d.partial", slash ? slash + 1 : path, (int)getpid());
    int rv = -1;
    int fd = openat(dir_fd, tmp.p, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0) {
        os_fail(tmp.p);
        goto out;
    }
    if (write_all(fd, data, len) < 0 || (durable && fsync(fd) < 0)) {
        os_fail(tmp.p);
        close(fd);
        goto out;
    }
    close(fd);
    if (renameat(dir_fd, tmp.p, dir_fd, path) < 0) {
        os_fail(path);
        goto out;
    }
    rv = 0;
out:
    free(tmp.p);
    return rv;
}

int makedirs(const char *path, mode_t mode)   /* os.makedirs(path, mode, exist_ok=True) */
{
    char *p = strdup(path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/')
            continue;
        *s = 0;
        if (mkdir(p, 0777) < 0 && errno != EEXIST) {
            os_fail(p);
            free(p);
            return -1;
        }
        *s = '/';
    }
    struct stat st;
    int e = mkdir(p, mode) < 0 ? errno : 0;
    if (e && (e != EEXIST || stat(p, &st) < 0 || !S_ISDIR(st.st_mode))) {
        errno = e;
        os_fail(p);
        free(p);
        return -1;
    }
    free(p);
    return 0;
}

int is_digits(const char *s, size_t n)
{
    if (!n)
        return 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9')
            return 0;
    return 1;
}

int starts(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

int ends(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* light_relay._safe: a name for a file, [A-Za-z0-9_.-] kept, every other character '_'. */
char *safe(const char *text, size_t limit)
{
    struct buf b = {0};
    buf_str(&b, "");
    size_t i = 0;
    for (size_t k = 0; text[i] && k < limit; k++) {
        size_t at = i;
        unsigned c = next_char(text, &i);
        char ch = (c < 0x80 && (((c | 0x20) >= 'a' && (c | 0x20) <= 'z') || (c >= '0' && c <= '9') || strchr("_.-", (int)c)))
                      ? text[at] : '_';
        buf_add(&b, &ch, 1);
    }
    return b.p;
}
