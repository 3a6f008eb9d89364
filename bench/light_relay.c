/* The C light rank's node aggregation (bench/light_rank.c), as bench/light_relay.py does it for the
 * Python rank and slurm_omni.elastic.heartbeat.NodeRelay for the runtime. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "light_rank.h"

#define MAX_BEATS_PER_NODE 256

/* -- the node's aggregation (bench/light_relay.py) ------------------------------------------------ */
struct copied {
    char name[128];
    unsigned long long ino, offset;
};

static int dir_entries(int dir_fd, char ***names)   /* os.scandir of an open folder */
{
    int fd = openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return os_fail(".");
    DIR *d = fdopendir(fd);
    if (!d) {
        close(fd);
        return os_fail(".");
    }
    int n = 0, cap = 16;
    char **out = malloc(sizeof *out * (size_t)cap);
    struct dirent *e;
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        if (n == cap)
            out = realloc(out, sizeof *out * (size_t)(cap *= 2));
        out[n++] = strdup(e->d_name);
    }
    closedir(d);
    *names = out;
    return n;
}

static void free_names(char **names, int n)
{
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
}

static long pid_of(const char *name)   /* lines-<RANK>-<PID>-<N>.jsonl: PID; -1 otherwise */
{
    if (!starts(name, "lines-") || !ends(name, ".jsonl"))
        return -1;
    const char *s = name + 6, *end = name + strlen(name) - 6;
    const char *a = memchr(s, '-', (size_t)(end - s));
    if (!a || !is_digits(s, (size_t)(a - s)))
        return -1;
    const char *b = memchr(a + 1, '-', (size_t)(end - a - 1));
    if (!b || !is_digits(a + 1, (size_t)(b - a - 1)) || !is_digits(b + 1, (size_t)(end - b - 1)))
        return -1;
    return strtol(a + 1, NULL, 10);
}

static int open_file(int dir_fd, const char *name, int flags, mode_t mode)   /* light_relay._open_file */
{
    int fd = openat(dir_fd, name, flags | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, mode);
    if (fd < 0)
        return os_fail(name);
    struct stat st;
    if (fstat(fd, &st) < 0 || st.st_uid != geteuid() || !S_ISREG(st.st_mode)) {
        close(fd);
        snprintf(oserr, sizeof oserr, "%s is not a regular file of uid %u", name, (unsigned)geteuid());
        return -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

static int read_copied(int dir_fd, struct copied **out)
{
    *out = NULL;
    int fd = openat(dir_fd, "lines-copied", O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0)
        return 0;
    size_t cap = 1 << 20;
    char *raw = malloc(cap + 1);
    ssize_t got = read(fd, raw, cap);
    close(fd);
    if (got < 0)
        got = 0;
    raw[got] = 0;
    int n = 0, size = 0;
    for (char *line = raw, *next; line && *line; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = 0;
        char *f[3] = {line, "", ""};
        char *sp = strchr(line, ' ');
        if (sp) {
            *sp = 0;
            f[1] = sp + 1;
            if ((sp = strchr(f[1], ' '))) {
                *sp = 0;
                f[2] = sp + 1;
                if ((sp = strchr(f[2], ' ')))
                    *sp = 0;
            }
        }
        if (pid_of(f[0]) < 0 || !is_digits(f[1], strlen(f[1])) || !is_digits(f[2], strlen(f[2])) || strlen(f[0]) >= 128)
            continue;
        if (n == size)
            *out = realloc(*out, sizeof **out * (size_t)(size = size ? 2 * size : 16));
        struct copied *c = &(*out)[n++];
        snprintf(c->name, sizeof c->name, "%s", f[0]);
        c->ino = strtoull(f[1], NULL, 10);
        c->offset = strtoull(f[2], NULL, 10);
    }
    free(raw);
    return n;
}

static struct copied *find_copied(struct copied *c, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(c[i].name, name))
            return &c[i];
    return NULL;
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const struct copied *)a)->name, ((const struct copied *)b)->name);
}


struct relay *relay_open(const char *base, const char *job_id, const char *node, long long rank,
                                const char *shared, double interval)
{
    if (!base[0] || !node[0])
        return NULL;
    char *j = safe(job_id, 64), *s = safe(node, 64);
    struct buf name = {0};
    buf_fmt(&name, "omni-beats-%u-%s-%s", (unsigned)geteuid(), j, s);
    free(j);
    free(s);
    char *path = join(base, name.p);
    free(name.p);
    int fd = -1;
    struct stat st;
    if ((mkdir(path, 0700) < 0 && errno != EEXIST) ||
        (fd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0 || fstat(fd, &st) < 0) {
        os_fail(path);
        if (fd >= 0)
            close(fd);
        fprintf(stderr, "light rank: couldn't aggregate on the node (%s); writing its own file\n", oserr);
        free(path);
        return NULL;
    }
    if (st.st_uid != geteuid() || (st.st_mode & 077)) {
        close(fd);
        fprintf(stderr, "light rank: couldn't aggregate on the node (%s is not ours and 0700 (uid %u, mode %o)); "
                "writing its own file\n", path, (unsigned)st.st_uid, (unsigned)(st.st_mode & 0777));
        free(path);
        return NULL;
    }
    struct relay *r = calloc(1, sizeof *r);
    r->fd = fd;
    r->path = path;
    r->node = strdup(node);
    r->shared = strdup(shared);
    snprintf(r->name, sizeof r->name, "rank-%lld.json", rank);
    r->interval = interval;
    r->lock_fd = r->lines_fd = r->metrics_fd = r->out_fd = -1;
    return r;
}

static int relay_copy_lines(struct relay *r)
{
    struct copied *copied, *done = NULL;
    int ncopied = read_copied(r->fd, &copied), ndone = 0;
    char **names;
    int n = dir_entries(r->fd, &names);
    if (n < 0) {
        free(copied);
        return -1;
    }
    struct buf out = {0};
    char **finished = calloc((size_t)n + 1, sizeof *finished);
    int nfinished = 0, rv = -1;
    done = calloc((size_t)n + 1, sizeof *done);
    for (int i = 0; i < n; i++) {
        long pid = pid_of(names[i]);
        if (pid < 0 || strlen(names[i]) >= sizeof done->name)
            continue;
        int src = open_file(r->fd, names[i], O_RDONLY, 0600);
        if (src < 0)
            continue;
        struct stat st;
        if (fstat(src, &st) < 0) {
            os_fail(names[i]);
            close(src);
            goto out;
        }
        unsigned long long size = (unsigned long long)st.st_size, start = 0, len = 0;
        struct copied *c = find_copied(copied, ncopied, names[i]);
        if (c && c->ino == (unsigned long long)st.st_ino && c->offset <= size)
            start = c->offset;
        if (size > start) {
            size_t want = size - start < (4u << 20) ? (size_t)(size - start) : (4u << 20);
            char *data = malloc(want);
            ssize_t got = pread(src, data, want, (off_t)start);
            if (got < 0) {
                os_fail(names[i]);
                free(data);
                close(src);
                goto out;
            }
            for (ssize_t k = got; k > 0; k--)
                if (data[k - 1] == '\n') {
                    len = (unsigned long long)k;
                    break;
                }
            buf_add(&out, data, (size_t)len);
            free(data);
        }
        close(src);
        struct copied *d = &done[ndone++];
        snprintf(d->name, sizeof d->name, "%s", names[i]);
        d->ino = (unsigned long long)st.st_ino;
        d->offset = start + len;
        if (start + len == size && pid != getpid() && now_s() - (double)st.st_mtim.tv_sec > 60 &&
            kill((pid_t)pid, 0) < 0)   /* ESRCH or EPERM: not a rank of ours */
            finished[nfinished++] = names[i];
    }
    if (out.len) {
        if (r->out_fd < 0) {
            char *s = safe(r->node, 200);
            struct buf name = {0};
            buf_fmt(&name, "node-%s.jsonl", s);
            free(s);
            r->out_fd = open_file(r->metrics_fd, name.p, O_RDWR | O_APPEND | O_CREAT, 0644);
            free(name.p);
            if (r->out_fd < 0)
                goto out;
        }
        struct stat st;
        char last = '\n';
        if (fstat(r->out_fd, &st) < 0 || (st.st_size && pread(r->out_fd, &last, 1, st.st_size - 1) < 0)) {
            os_fail("node file");
            goto out;
        }
        if (last != '\n' && write_all(r->out_fd, "\n", 1) < 0)   /* a leader killed inside its write left a torn line */
            goto fail_write;
        if (write_all(r->out_fd, out.p, out.len) < 0)
            goto fail_write;
    }
    int same = ndone == ncopied;
    for (int i = 0; same && i < ndone; i++) {
        struct copied *c = find_copied(copied, ncopied, done[i].name);
        same = c && c->ino == done[i].ino && c->offset == done[i].offset;
    }
    if (out.len || !same) {
        qsort(done, (size_t)ndone, sizeof *done, by_name);
        struct buf list = {0};
        buf_str(&list, "");
        for (int i = 0; i < ndone; i++)
            buf_fmt(&list, "%s %llu %llu\n", done[i].name, done[i].ino, done[i].offset);
        int w = write_atomic(r->fd, "lines-copied", list.p, list.len, 0);
        free(list.p);
        if (w < 0)
            goto out;
    }
    for (int i = 0; i < nfinished; i++)
        unlinkat(r->fd, finished[i], 0);
    rv = 0;
    goto out;
fail_write:
    os_fail("node file");
out:
    free(out.p);
    free(finished);
    free(done);
    free(copied);
    free_names(names, n);
    return rv;
}

static int relay_publish(struct relay *r, double now)
{
    char **names;
    int n = dir_entries(r->fd, &names);
    if (n < 0)
        return -1;
    struct found {
        unsigned long long life;
        char *raw;
        size_t len;
    } *found = calloc((size_t)n + 1, sizeof *found);
    int nfound = 0, rv = -1;
    unsigned long long newest = 0;
    for (int i = 0; i < n; i++) {
        if (!starts(names[i], "rank-") || !ends(names[i], ".json"))
            continue;
        int fd = openat(r->fd, names[i], O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0)
            continue;   /* replaced or removed meanwhile */
        char *raw = malloc(4098);
        ssize_t got = read(fd, raw, 4097);
        close(fd);
        if (got < 0) {
            os_fail(names[i]);
            free(raw);
            goto out;
        }
        size_t a = 0, z = (size_t)got;
        while (a < z && strchr(" \t\n\r\v\f", raw[a]))
            a++;
        while (z > a && strchr(" \t\n\r\v\f", raw[z - 1]))
            z--;
        raw[z] = 0;
        char *at = memmem(raw + a, z - a, "\"incarnation\":", 14);
        size_t dn = 0;
        if (at) {
            char *d = at + 14;
            size_t room = (size_t)(raw + z - d) < 20 ? (size_t)(raw + z - d) : 20;
            while (dn < room && d[dn] != ',')
                dn++;
        }
        if (z - a <= 4096 && z > a && raw[a] == '{' && raw[z - 1] == '}' && !memchr(raw + a, '\n', z - a) && at &&
            is_digits(at + 14, dn)) {
            unsigned long long life = strtoull(at + 14, NULL, 10);
            memmove(raw, raw + a, z - a);
            found[nfound++] = (struct found){life, raw, z - a};
            if (life > newest)
                newest = life;
        } else {
            free(raw);
        }
    }
    struct buf data = {0};
    int beats = 0;
    for (int i = 0; i < nfound && beats < MAX_BEATS_PER_NODE; i++) {
        if (found[i].life != newest)
            continue;
        if (!beats++) {
            buf_str(&data, "{\"node\":");
            json_str(&data, r->node);
            buf_str(&data, ",\"time\":");
            put_float(&data, now, 0);
            buf_str(&data, "}\n");
        }
        buf_add(&data, found[i].raw, found[i].len);
        buf_str(&data, "\n");
    }
    if (beats) {
        char *s = safe(r->node, 200);
        struct buf name = {0};
        buf_fmt(&name, "node-%s.jsonl", s);
        char *path = join(r->shared, name.p);
        int w = write_atomic(AT_FDCWD, path, data.p, data.len, 0);
        free(s);
        free(name.p);
        free(path);
        free(data.p);
        if (w < 0)
            goto out;
    }
    struct buf stamp = {0};
    put_float(&stamp, now, 0);
    int w = write_atomic(r->fd, "published", stamp.p, stamp.len, 0);
    free(stamp.p);
    if (w < 0)
        goto out;
    r->published_at = now_s();
    if (r->metrics_fd >= 0 && now >= r->lines_due) {   /* once per interval: every other pass */
        r->lines_due = now + 0.75 * r->interval;
        if (relay_copy_lines(r) < 0)   /* the beats are published; the lines wait for the next pass */
            fprintf(stderr, "light rank: couldn't copy the node's metrics lines: %s\n", oserr);
    }
    rv = 0;
out:
    for (int i = 0; i < nfound; i++)
        free(found[i].raw);
    free(found);
    free_names(names, n);
    return rv;
}

/* The node's lead ("leader": generation and pid of its holder); 0 0 when none wrote it. */
static void read_leader(int dir_fd, long *gen, long *pid)
{
    *gen = *pid = 0;
    int fd = openat(dir_fd, "leader", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return;
    char buf[64];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return;
    buf[n] = 0;
    long g, p;
    char extra;
    if (sscanf(buf, "%ld %ld %c", &g, &p, &extra) == 2 && g >= 0 && p >= 0)
        *gen = g, *pid = p;
}

/* pid runs or waits (D state too): not stopped, gone or a zombie. */
static int running(long pid)
{
    if (pid <= 0)
        return 0;
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *paren = strrchr(buf, ')');
    if (!paren || !paren[1] || !paren[2])
        return 0;
    return !strchr("TtZX", paren[2]);
}

/* This rank holds generation gen's lock now (the leader): 1; it is held: 0; -1 with oserr set. */
static int relay_take(struct relay *r, long gen)
{
    if (r->lock_fd >= 0 && r->lock_gen != gen) {
        close(r->lock_fd);
        r->lock_fd = -1;
    }
    if (r->lock_fd < 0) {
        char name[32];
        if (gen <= 0)
            snprintf(name, sizeof name, "lock");
        else
            snprintf(name, sizeof name, "lock-%ld", gen);
        r->lock_fd = openat(r->fd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (r->lock_fd < 0)
            return os_fail("lock");
        r->lock_gen = (int)gen;
    }
    if (flock(r->lock_fd, LOCK_EX | LOCK_NB) < 0) {
        if (errno == EWOULDBLOCK)
            return 0;
        return os_fail("lock");
    }
    r->leader = 1;
    return 1;
}

/* As the leader (the holder of the folder's lock), the node's beats twice per interval. A rank leads
 * when the lock is free, or over from a stopped or gone leader ("leader": its generation and pid)
 * when the node's copy is 1.5 intervals late, with the next generation's lock; a leader that sees a
 * newer generation steps down (elastic/heartbeat.py NodeRelay.lead). -1: a lock could not be opened. */
int relay_lead(struct relay *r, double now)
{
    long gen, pid;
    read_leader(r->fd, &gen, &pid);
    if (r->leader && gen > r->lock_gen) {   /* taken over while this rank was stopped: step down */
        close(r->lock_fd);
        r->lock_fd = -1;
        r->leader = 0;
    }
    if (!r->leader) {
        int took = relay_take(r, gen);
        if (took < 0)
            return -1;
        if (!took) {
            struct stat st;
            double late = 1e300;
            if (fstatat(r->fd, "published", &st, AT_SYMLINK_NOFOLLOW) == 0)
                late = now - ((double)st.st_mtim.tv_sec + (double)st.st_mtim.tv_nsec * 1e-9);
            /* no leader named yet (pid 0): the lock's holder is between its lock and its name */
            if (late <= 1.5 * r->interval || pid <= 0 || running(pid))
                return 0;
            if ((took = relay_take(r, gen + 1)) <= 0)
                return took;
            r->takeovers++;
            fprintf(stderr, "light rank: the node's leader (pid %ld) is stopped or gone and its copy %.1f s late: "
                    "this rank leads\n", pid, late);
        }
        read_leader(r->fd, &gen, &pid);
        if (gen > r->lock_gen) {   /* taken over meanwhile: naming this rank would hide the newer lead */
            close(r->lock_fd);
            r->lock_fd = -1;
            r->leader = 0;
            return 0;
        }
        char stamp[64];
        int len = snprintf(stamp, sizeof stamp, "%d %ld", r->lock_gen, (long)getpid());
        if (write_atomic(r->fd, "leader", stamp, (size_t)len, 0) < 0)
            fprintf(stderr, "light rank: couldn't name this rank the node's leader: %s\n", oserr);
        r->next_publish = 0;
    }
    if (now < r->next_publish)
        return 0;
    r->next_publish = now + r->interval / 2;
    if (relay_publish(r, now) < 0)
        fprintf(stderr, "light rank: couldn't publish the node's beats: %s\n", oserr);
    return 0;
}

static void relay_remove_if_last(struct relay *r)   /* the node's last rank leaves no folder */
{
    char **names;
    int n = dir_entries(r->fd, &names);
    if (n < 0)
        return;
    int busy = 0;
    for (int i = 0; i < n; i++)
        busy |= (starts(names[i], "rank-") || starts(names[i], "lines-")) && strcmp(names[i], "lines-copied");
    free_names(names, n);
    if (busy)
        return;
    const char *left[] = {"published", "leader", "lines-copied"};
    for (int i = 0; i < 3; i++)
        if (unlinkat(r->fd, left[i], 0) < 0 && errno != ENOENT)
            return;
    if ((n = dir_entries(r->fd, &names)) < 0)
        return;
    for (int i = 0; i < n; i++)   /* "lock" and the takeovers' "lock-<generation>" */
        if ((!strcmp(names[i], "lock") || starts(names[i], "lock-")) && unlinkat(r->fd, names[i], 0) < 0
            && errno != ENOENT)
            busy = 1;
    free_names(names, n);
    if (!busy)
        rmdir(r->path);
}

/* The node's last rank of a life that ends removes the folder (relay_remove_if_last); a rank of the
 * next life on the same node may have opened it just before (between its relay_open and its first
 * beat: seconds at load 1,000+, issue 19). A removed folder takes no new file (ENOENT), so open the
 * folder at its path again and leave the lead of the old one (elastic/heartbeat.py
 * NodeRelay._reopen_if_removed). Not once this rank's beat was in it: the last rank never removes a
 * folder holding a beat, so the job's end did, and a folder made again would stay behind the rank.
 * 0, or -1 with oserr set (the rank then writes its own file). */
static int relay_reopen_if_removed(struct relay *r)
{
    struct stat st;
    if (fstat(r->fd, &st) < 0)
        return os_fail(r->path);
    if (st.st_nlink > 0)
        return 0;
    if (r->beat_here) {   /* the job's end removed it (NodeRelay._reopen_if_removed): its own file */
        snprintf(oserr, sizeof oserr, "%s was removed after this rank beat there (the job's end)", r->path);
        return -1;
    }
    if (r->lock_fd >= 0)
        close(r->lock_fd);   /* releases the lead of the removed folder */
    r->lock_fd = -1;
    r->leader = 0;
    int fd = -1;
    if ((mkdir(r->path, 0700) < 0 && errno != EEXIST) ||
        (fd = open(r->path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0 || fstat(fd, &st) < 0) {
        os_fail(r->path);
        if (fd >= 0)
            close(fd);
        return -1;
    }
    if (st.st_uid != geteuid() || (st.st_mode & 077)) {
        close(fd);
        snprintf(oserr, sizeof oserr, "%s is not ours and 0700 (uid %u, mode %o)", r->path, (unsigned)st.st_uid,
                 (unsigned)(st.st_mode & 0777));
        return -1;
    }
    close(r->fd);
    r->fd = fd;
    /* one line per reopen (rare: the scale bench's logs show how often the race comes) */
    fprintf(stderr, "light rank: the node folder %s was removed under this rank (the life before's last rank "
            "left): opened again\n", r->path);
    return 0;
}

/* This rank's beat on the node (the last one: removed, the lead handed over); *published: when a
 * leader last published (0: never). */
int relay_beat(struct relay *r, const char *data, size_t len, double now, int last, double *published)
{
    *published = 0;
    if (!last && relay_reopen_if_removed(r) < 0)
        return -1;
    if (last) {
        if (unlinkat(r->fd, r->name, 0) < 0 && errno != ENOENT)
            return os_fail(r->name);
        if (r->leader) {
            r->next_publish = r->lines_due = 0;   /* the last pass copies every line there is */
            relay_lead(r, now);
            close(r->lock_fd);
            r->lock_fd = -1;
            r->leader = 0;
        }
        relay_remove_if_last(r);
        return 0;
    }
    if (write_atomic(r->fd, r->name, data, len, 0) < 0)
        return -1;
    r->beat_here = 1;
    r->next_publish = 0;
    if (relay_lead(r, now) < 0)
        return -1;
    if (r->leader && r->published_at >= now) {
        *published = r->published_at;
        return 0;
    }
    struct stat st;
    if (fstatat(r->fd, "published", &st, AT_SYMLINK_NOFOLLOW) == 0)
        *published = (double)st.st_mtim.tv_sec + (double)st.st_mtim.tv_nsec * 1e-9;
    else if (errno != ENOENT)
        return os_fail("published");
    return 0;
}

/* The node's lines copied by this rank when it leads, and with `own` this rank's lines go to the node
 * (0: the folder is not usable, the caller appends them). */
int relay_open_lines(struct relay *r, const char *metrics_dir, long long rank, int own)
{
    r->metrics_fd = open(metrics_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (r->metrics_fd < 0)
        os_fail(metrics_dir);
    else if (own) {
        snprintf(r->lines_name, sizeof r->lines_name, "lines-%lld-%d-0.jsonl", rank, (int)getpid());
        r->lines_fd = open_file(r->fd, r->lines_name, O_WRONLY | O_APPEND | O_CREAT, 0600);
    }
    if (r->metrics_fd < 0 || (own && r->lines_fd < 0)) {
        fprintf(stderr, "light rank: couldn't write metrics on the node (%s); appending its own file\n", oserr);
        return 0;
    }
    return 1;
}

/* What no leader copied of this rank's lines to its own file (open for appending), its file on the
 * node removed; 0, or -1 with oserr set. */
static int rest_to(struct relay *r, int own_fd)
{
    struct copied *copied;
    int ncopied = read_copied(r->fd, &copied), src = -1, rv = -1;
    struct stat st;
    char *rest = NULL;
    if (fstat(r->lines_fd, &st) < 0) {
        os_fail(r->lines_name);
        goto out;
    }
    unsigned long long size = (unsigned long long)st.st_size, start = 0;
    struct copied *c = find_copied(copied, ncopied, r->lines_name);
    if (c && c->ino == (unsigned long long)st.st_ino && c->offset <= size)
        start = c->offset;
    if ((src = open_file(r->fd, r->lines_name, O_RDONLY, 0600)) < 0)
        goto out;
    size_t len = size > start ? (size_t)(size - start) : 0;
    rest = malloc(len + 1);
    ssize_t got = len ? pread(src, rest, len, (off_t)start) : 0;
    if (got < 0) {
        os_fail(r->lines_name);
        goto out;
    }
    while (got > 0 && rest[got - 1] != '\n')
        got--;
    if (got > 0 && write_all(own_fd, rest, (size_t)got) < 0) {
        os_fail("metrics file");
        goto out;
    }
    if (unlinkat(r->fd, r->lines_name, 0) < 0) {
        os_fail(r->lines_name);
        goto out;
    }
    rv = 0;
out:
    if (src >= 0)
        close(src);
    free(rest);
    free(copied);
    return rv;
}

/* This rank ends: its lines' rest to its own file (the loss rank has none on the node: it only
 * copied the others'), the node's files closed. */
void relay_close_lines(struct relay *r, int own_fd)
{
    if (r->lines_fd >= 0 && rest_to(r, own_fd) < 0)   /* its lines stay on the node for the next leader */
        fprintf(stderr, "light rank: couldn't finish its metrics lines on the node: %s\n", oserr);
    int *fds[] = {&r->lines_fd, &r->out_fd, &r->metrics_fd};
    for (int i = 0; i < 3; i++) {
        if (*fds[i] >= 0)
            close(*fds[i]);
        *fds[i] = -1;
    }
    relay_remove_if_last(r);
}
