/* The scale lane's light rank in C (issue 19): bench/light_rank.py's contract, byte for byte.
 *
 *     cc -O2 -Wall -Wextra -Werror -o light_rank bench/light_rank.c bench/light_relay.c bench/light_io.c
 *     (the scale bench does this: bench/light_build.py)
 *
 * This file is the rank (its environment, beats, steps, markers, the rendezvous); light_relay.c its
 * node aggregation, light_io.c bytes, JSON and files as Python's json, msgspec and fsio write them.
 * bench/light_rank.py (and bench/light_relay.py, its node aggregation) is the reference and its
 * docstring the contract: the same environment, heartbeat files (per rank, or per node through a
 * node-local folder whose lock holder copies the node's beats), metrics lines (per node when the
 * beats are), checkpoint markers, rendezvous protocol and agreement, exit codes and signals (SIGUSR1
 * and SIGTERM save and exit 75; SIGURG: a collective that never returns), and the cgroup join
 * (OMNI_LIGHT_CGROUP). tests/supervisor/test_light_rank.py holds both ranks to it with the package's
 * own readers.
 *
 * Why C: a Python rank costs ~20 ms of CPU to start and ~0.5 ms per second of steady state; at 512
 * emulated nodes x 4 ranks on one 2-core host that was 40 CPU s per relaunch and half the machine in
 * steady state, which starved slurmctld. What Python does implicitly is done here on purpose:
 * SIGPIPE ignored, environment strings read as Python reads them (UTF-8, undecodable bytes as
 * surrogates) so that the JSON bytes are those of json/msgspec, floats written as repr() writes
 * them (and as msgspec does, for the records).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "light_rank.h"

#define BLOCK_SIGNAL SIGURG
#define MAX_ERROR_CHARS 400
#define BACKOFF_CAP_S 0.5   /* a refused rank's longest pause (the rendezvous below) */
#define PROBE_CAP_S 0.125   /* ... when it tries for its whole node */

/* -- the rank ----------------------------------------------------------------------------------- */
static struct {
    long long rank, world, dp, stage, dp_rank, incarnation, max_steps, every, port;
    double interval, step_delay, started_at, next_beat, start_at, direct_at;
    const char *master, *node;
    const char *finish_file;   /* OMNI_LIGHT_FINISH_FILE: the scale bench's finish time (light_rank.py's text) */
    int finish_read;   /* the finish time was read: max_steps is the last step */
    const char *job;   /* the job's id; job_id: its first 63 characters, as the beat carries it */
    char *job_id, *stage_name, *ckpt_dir, *hb_dir, *metrics_dir, *mine, *hb_path, *metrics_path;
    struct relay *relay;
    int node_failed, metrics_fd, finishing;
    int reports_loss;   /* replica 0 of the last stage (Layout.reports_loss): its lines straight to its file */
    char per_node[64];   /* OMNI_METRICS_PER_NODE, stripped and lowered */
    int node_lines;   /* the node's metrics lines are open: this rank copies them when it leads */
    int via_node;   /* this rank's lines go through the node (not the loss rank's: elastic/node_metrics.py) */
    /* the heartbeat (formats/heartbeat.HeartbeatRecord, its keys in order) */
    long long step, beats, last_ckpt;
    int has_step_time, has_last_ckpt, has_exit, exit_code;
    double time, step_time;
    const char *phase;
    char *error;
} R;

static volatile sig_atomic_t stop_signal, blocked;

static void on_signal(int sig) { stop_signal = sig; }
static void on_block(int sig) { (void)sig; blocked = 1; }

static int finish(int code, const char *phase, const char *error);

/* An error no restart can fix (exit 78) or a crash (exit 1): said on one line and in the last beat. */
__attribute__((noreturn)) static void fail(int code, const char *msg)
{
    if (code == EXIT_BAD_INPUT)
        fprintf(stderr, "%s\n", msg);
    else
        fprintf(stderr, "light rank %lld: %s\n", R.rank, msg);
    if (R.finishing)
        _exit(EXIT_FAILED);
    exit(finish(code, "failed", msg));
}

__attribute__((noreturn)) static void crash_os(void)
{
    char msg[1300];
    snprintf(msg, sizeof msg, "OSError: %s", oserr);
    fail(EXIT_FAILED, msg);
}

static const char *env_get(const char *name) { return getenv(name); }

static const char *env_or(const char *name, const char *dflt)   /* env.get(name) or dflt */
{
    const char *v = getenv(name);
    return v && v[0] ? v : dflt;
}

static char bad_env[600];

static int strip(const char *raw, const char **a, size_t *n)
{
    const char *s = raw, *e = raw + strlen(raw);
    while (s < e && strchr(" \t\n\r\v\f", *s))
        s++;
    while (e > s && strchr(" \t\n\r\v\f", e[-1]))
        e--;
    *a = s;
    *n = (size_t)(e - s);
    return *n > 0;
}

static void bad_value(const char *name, const char *raw, const char *kind)
{
    struct buf b = {0};
    char *h = head(raw, 80);
    buf_fmt(&b, "light rank: couldn't read %s: ", name);
    put_repr(&b, h);
    buf_fmt(&b, " is not %s", kind);
    snprintf(bad_env, sizeof bad_env, "%s", b.p);
    free(h);
    free(b.p);
}

/* _int: the variable as Python's int() reads it, dflt when unset or empty; 0 and bad_env set when bad. */
static int env_int(const char *name, long long dflt, long long *out)
{
    const char *raw = env_or(name, "");
    if (!raw[0]) {
        *out = dflt;
        return 1;
    }
    const char *s;
    size_t n;
    char digits[64];
    size_t k = 0;
    if (strip(raw, &s, &n)) {
        size_t i = 0;
        if (s[0] == '+' || s[0] == '-')
            digits[k++] = s[i++];
        for (; i < n && k < sizeof digits - 1; i++) {
            if (s[i] == '_' && i > 0 && s[i - 1] >= '0' && s[i - 1] <= '9' && i + 1 < n && s[i + 1] >= '0' && s[i + 1] <= '9')
                continue;
            digits[k++] = s[i];
        }
        digits[k] = 0;
        char *end;
        errno = 0;
        long long v = strtoll(digits, &end, 10);
        if (i == n && k && *end == 0 && end != digits && digits[k - 1] >= '0' && digits[k - 1] <= '9' && !errno) {
            *out = v;
            return 1;
        }
    }
    bad_value(name, raw, "an integer");
    return 0;
}

static int env_float(const char *name, double dflt, double *out)
{
    const char *raw = env_or(name, "");
    if (!raw[0]) {
        *out = dflt;
        return 1;
    }
    const char *s;
    size_t n;
    if (strip(raw, &s, &n) && n < 64 && !memchr(s, 'x', n) && !memchr(s, 'X', n)) {
        char text[64], *end;
        memcpy(text, s, n);
        text[n] = 0;
        double v = strtod(text, &end);
        if (*end == 0 && end != text) {
            *out = v;
            return 1;
        }
    }
    bad_value(name, raw, "a number");
    return 0;
}

static long long floordiv(long long a, long long b) { return a / b - ((a % b != 0) && ((a < 0) != (b < 0))); }

/* The rank from its environment (elastic/layout.py's names); 0 and bad_env set when a number is bad. */
static int setup(void)
{
    long long procid, v;
    if (!env_int("SLURM_PROCID", 0, &procid) || !env_int("RANK", procid, &R.rank) || !env_int("WORLD_SIZE", 1, &R.world))
        return 0;
    char *stages_raw = strdup(env_or("OMNI_STAGES", "")), *save = NULL;
    char *stages[256];
    int nstages = 0;
    for (char *t = strtok_r(stages_raw, ",", &save); t && nstages < 256; t = strtok_r(NULL, ",", &save))
        stages[nstages++] = t;
    if (!nstages)
        stages[nstages++] = "main";
    int colocated = nstages == 1;
    if (!env_int("OMNI_DP_SIZE", colocated ? R.world : floordiv(R.world, nstages), &R.dp))
        return 0;
    long long dp1 = R.dp > 1 ? R.dp : 1;
    R.stage = 0;
    if (!colocated && !env_int("OMNI_STAGE", floordiv(R.rank, dp1), &R.stage))
        return 0;
    if (!env_int("OMNI_DP_RANK", R.rank - floordiv(R.rank, dp1) * dp1, &R.dp_rank))
        return 0;
    R.stage_name = strdup(colocated ? stages[0] : R.stage < nstages && R.stage >= -nstages
                                                      ? stages[R.stage < 0 ? R.stage + nstages : R.stage] : "?");
    R.reports_loss = (colocated || R.stage == nstages - 1) && R.dp_rank == 0;
    free(stages_raw);
    const char *per_node, *raw_pn = env_or("OMNI_METRICS_PER_NODE", "");
    size_t pn;
    strip(raw_pn, &per_node, &pn);
    pn = pn < sizeof R.per_node - 1 ? pn : sizeof R.per_node - 1;
    for (size_t i = 0; i < pn; i++)
        R.per_node[i] = (char)(per_node[i] >= 'A' && per_node[i] <= 'Z' ? per_node[i] | 0x20 : per_node[i]);
    R.per_node[pn] = 0;
    if (!env_int("SLURM_RESTART_COUNT", 0, &v) || !env_int("OMNI_INCARNATION", v, &R.incarnation))
        return 0;
    R.job = env_or("OMNI_JOB_ID", env_or("SLURM_JOB_ID", "local"));
    R.job_id = head(R.job, 63);
    const char *run_dir = env_or("OMNI_RUN_DIR", "omni-run");
    R.ckpt_dir = env_get("OMNI_CKPT_DIR") && env_get("OMNI_CKPT_DIR")[0] ? strdup(env_get("OMNI_CKPT_DIR")) : join(run_dir, "ckpt");
    R.hb_dir = env_get("OMNI_HEARTBEAT_DIR") && env_get("OMNI_HEARTBEAT_DIR")[0] ? strdup(env_get("OMNI_HEARTBEAT_DIR"))
                                                                                : join(run_dir, "heartbeat");
    R.metrics_dir = env_get("OMNI_METRICS_DIR") && env_get("OMNI_METRICS_DIR")[0] ? strdup(env_get("OMNI_METRICS_DIR"))
                                                                                 : join(run_dir, "metrics");
    if (!env_float("OMNI_HEARTBEAT_INTERVAL", 2.0, &R.interval) || !env_float("OMNI_STEP_DELAY_S", 0.1, &R.step_delay) ||
        !env_int("OMNI_MAX_STEPS", 100, &R.max_steps) || !env_int("OMNI_LIGHT_CKPT_EVERY", 5, &R.every))
        return 0;
    R.master = env_get("MASTER_ADDR") ? env_get("MASTER_ADDR") : "";
    if (!env_int("MASTER_PORT", 0, &R.port))
        return 0;
    R.node = env_get("SLURMD_NODENAME") ? env_get("SLURMD_NODENAME") : "";
    R.finish_file = env_or("OMNI_LIGHT_FINISH_FILE", "");
    struct buf b = {0};
    buf_fmt(&b, "light/rank-%lld", R.rank);
    R.mine = join(R.ckpt_dir, b.p);
    buf_reset(&b);
    buf_fmt(&b, "rank-%lld.json", R.rank);
    R.hb_path = join(R.hb_dir, b.p);
    free(b.p);
    R.step = -1;
    R.phase = "starting";
    R.error = strdup("");
    R.metrics_fd = -1;
    /* node_dir_setting: /dev/shm when unset; "", off, none, 0: a file per rank */
    const char *raw = env_get("OMNI_HEARTBEAT_NODE_DIR");
    struct stat st;
    const char *node_dir = raw ? raw : stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) ? "/dev/shm" : "";
    if (raw) {
        const char *s;
        size_t n;
        strip(raw, &s, &n);
        const char *off[] = {"off", "none", "0"};
        int is_off = n == 0;
        for (int i = 0; i < 3 && !is_off; i++)
            is_off = n == strlen(off[i]) && strncasecmp(s, off[i], n) == 0;
        if (is_off)
            node_dir = "";
    }
    if (node_dir[0] && R.node[0])
        R.relay = relay_open(node_dir, R.job, R.node, R.rank, R.hb_dir, R.interval);
    return 1;
}

static void encode_beat(struct buf *b)
{
    buf_reset(b);
    buf_fmt(b, "{\"rank\":%lld,\"stage\":%lld,\"dp_rank\":%lld,\"pid\":%d,\"incarnation\":%lld,\"job_id\":", R.rank,
            R.stage, R.dp_rank, (int)getpid(), R.incarnation);
    json_str(b, R.job_id);
    buf_fmt(b, ",\"step\":%lld,\"phase\":", R.step);
    json_str(b, R.phase);
    buf_str(b, ",\"time\":");
    put_float(b, R.time, 1);
    buf_str(b, ",\"step_time_s\":");
    if (R.has_step_time)
        put_float(b, R.step_time, 1);
    else
        buf_str(b, "null");
    if (R.has_last_ckpt)
        buf_fmt(b, ",\"last_checkpoint_step\":%lld", R.last_ckpt);
    else
        buf_str(b, ",\"last_checkpoint_step\":null");
    buf_fmt(b, ",\"beats\":%lld,\"node\":", R.beats);
    json_str(b, R.node);
    buf_str(b, ",\"compute_s\":null,\"data_s\":null,\"cpu_wait_s\":null,\"metrics\":{},\"error\":");
    json_str(b, R.error);
    if (R.has_exit)
        buf_fmt(b, ",\"exit_code\":%d}\n", R.exit_code);
    else
        buf_str(b, ",\"exit_code\":null}\n");
}

static void beat(int force, int last)
{
    static struct buf data;
    double now = now_s();
    if (!force && now < R.next_beat) {
        /* the leader publishes twice per interval; a folder removed under it (the node's last rank
         * of the life before left as this one came) is not this rank's end: its beats go to its own
         * file, as elastic/heartbeat.py's do */
        if (R.relay && relay_lead(R.relay, now) < 0 && !R.node_failed) {
            fprintf(stderr, "light rank: couldn't lead the node's folder: %s\n", oserr);
            R.node_failed = 1;
        }
        return;
    }
    R.next_beat = now + R.interval;
    R.beats++;
    R.time = now;
    encode_beat(&data);
    int direct = !R.relay || last;
    if (R.relay) {
        double published;
        if (relay_beat(R.relay, data.p, data.len, now, last, &published) < 0) {
            if (!R.node_failed)   /* once, not every interval */
                fprintf(stderr, "light rank: couldn't beat on the node: %s\n", oserr);
            R.node_failed = 1;
            published = 0;
            direct = 1;   /* no rank of the node can relay this beat: its own file */
        }
        if (R.direct_at && published > R.direct_at && !last) {
            R.direct_at = 0;
            unlink(R.hb_path);   /* the node's copy carries this beat or a newer one */
        }
    }
    if (!direct)
        return;
    if (write_atomic(AT_FDCWD, R.hb_path, data.p, data.len, 0) < 0)   /* a flaky disk: the beat goes stale */
        fprintf(stderr, "light rank: couldn't write %s: %s\n", R.hb_path, oserr);
    else
        R.direct_at = now;
}

static int one_of(const char *value, const char *const *allowed)
{
    for (; *allowed; allowed++)
        if (!strcmp(value, *allowed))
            return 1;
    return 0;
}

static const char *const PER_NODE_OFF[] = {"0", "off", "false", "no", NULL};
static const char *const PER_NODE_ANY[] = {"", "1", "on", "true", "yes", "0", "off", "false", "no", NULL};

struct first {
    int set;
    double task_started_at, groups_ready_at, restored_at;
    long long restored_step;
};

static void log_metrics(long long step, double step_time, const struct first *first)
{
    static struct buf line;
    if (R.metrics_fd < 0) {
        if (makedirs(R.metrics_dir, 0777) < 0)
            crash_os();
        struct buf name = {0};
        buf_fmt(&name, "metrics-%s-%lld.jsonl", R.stage_name, R.dp_rank);
        R.metrics_path = join(R.metrics_dir, name.p);
        R.metrics_fd = open(R.metrics_path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
        if (R.metrics_fd < 0)
            crash_os();
        /* lines per node unless OMNI_METRICS_PER_NODE=0 (formats.metrics.per_node_setting), the loss
         * rank's straight to its own file: a lost node costs only other ranks' lines of one interval */
        R.node_lines = R.relay && !one_of(R.per_node, PER_NODE_OFF) &&
                       relay_open_lines(R.relay, R.metrics_dir, R.rank, !R.reports_loss);
        R.via_node = R.node_lines && !R.reports_loss;
        free(name.p);
    }
    buf_reset(&line);
    buf_str(&line, "{\"time\":");
    put_float(&line, now_s(), 1);
    buf_fmt(&line, ",\"rank\":%lld,\"stage\":%lld,\"dp_rank\":%lld,\"incarnation\":%lld,\"step\":%lld,"
            "\"step_time_seconds\":", R.rank, R.stage, R.dp_rank, R.incarnation, step);
    put_float(&line, step_time, 1);
    buf_fmt(&line, ",\"data_parallel_size\":%lld", R.dp);
    if (first->set) {
        buf_str(&line, ",\"task_started_at\":");
        put_float(&line, first->task_started_at, 1);
        buf_str(&line, ",\"groups_ready_at\":");
        put_float(&line, first->groups_ready_at, 1);
        buf_str(&line, ",\"restored_at\":");
        put_float(&line, first->restored_at, 1);
        buf_fmt(&line, ",\"restored_step\":%lld", first->restored_step);
    }
    if (R.via_node) {   /* per node: the leader copies it into <metrics>/node-<NODE>.jsonl */
        buf_str(&line, ",\"file\":");
        json_str(&line, strrchr(R.metrics_path, '/') ? strrchr(R.metrics_path, '/') + 1 : R.metrics_path);
        buf_str(&line, "}\n");
        if (write_all(R.relay->lines_fd, line.p, line.len) < 0) {
            os_fail(R.relay->lines_name);
            crash_os();
        }
    } else {
        buf_str(&line, "}\n");
        if (write_all(R.metrics_fd, line.p, line.len) < 0) {
            os_fail(R.metrics_path);
            crash_os();
        }
    }
}

static int by_ll(const void *a, const void *b)
{
    long long x = *(const long long *)a, y = *(const long long *)b;
    return (x > y) - (x < y);
}

/* The steps this rank holds a marker of, oldest first. */
static int markers(long long **out)
{
    *out = NULL;
    DIR *d = opendir(R.mine);
    if (!d) {
        if (errno == ENOENT)
            return 0;
        os_fail(R.mine);
        crash_os();
    }
    int n = 0, cap = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len <= 10 || !starts(e->d_name, "step-") || !ends(e->d_name, ".json") || !is_digits(e->d_name + 5, len - 10))
            continue;
        if (n == cap)
            *out = realloc(*out, sizeof **out * (size_t)(cap = cap ? 2 * cap : 16));
        (*out)[n++] = strtoll(e->d_name + 5, NULL, 10);
    }
    closedir(d);
    qsort(*out, (size_t)n, sizeof **out, by_ll);
    return n;
}

static char *marker_path(long long step)
{
    struct buf b = {0};
    buf_fmt(&b, "step-%lld.json", step);
    char *p = join(R.mine, b.p);
    free(b.p);
    return p;
}

static void prune(long long below)   /* markers older than the step every rank restored */
{
    long long *held;
    int n = markers(&held);
    for (int i = 0; i < n; i++)
        if (held[i] < below) {
            char *p = marker_path(held[i]);
            unlink(p);
            free(p);
        }
    free(held);
}

static void save(long long step)   /* this rank's marker of step, durable before it counts */
{
    R.phase = "checkpointing";
    beat(1, 0);
    if (makedirs(R.mine, 0777) < 0)
        crash_os();
    struct buf data = {0};
    buf_fmt(&data, "{\"rank\":%lld,\"step\":%lld,\"incarnation\":%lld,\"time\":", R.rank, step, R.incarnation);
    put_float(&data, now_s(), 1);
    buf_str(&data, "}\n");
    char *p = marker_path(step);
    if (write_atomic(AT_FDCWD, p, data.p, data.len, 1) < 0)
        crash_os();
    free(p);
    free(data.p);
    R.phase = "training";
    R.has_last_ckpt = 1;
    R.last_ckpt = step;
    beat(1, 0);
}

/* -- the rendezvous: the newest step every rank holds --------------------------------------------- */
static int master_addr(struct sockaddr_in *sa, int for_bind)
{
    memset(sa, 0, sizeof *sa);
    sa->sin_family = AF_INET;
    sa->sin_port = htons((unsigned short)R.port);
    const char *host = R.master;
    if (for_bind && strcmp(host, "127.0.0.1") && strcmp(host, "localhost"))
        host = "";
    if (!host[0]) {
        sa->sin_addr.s_addr = htonl(INADDR_ANY);
        return 0;
    }
    if (inet_pton(AF_INET, host, &sa->sin_addr) == 1)
        return 0;
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res;
    int rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc) {
        snprintf(oserr, sizeof oserr, "[Errno %d] %s", rc, gai_strerror(rc));
        return -1;
    }
    sa->sin_addr = ((struct sockaddr_in *)res->ai_addr)->sin_addr;
    freeaddrinfo(res);
    return 0;
}

static void set_timeout(int fd, int opt, double s)
{
    struct timeval tv = {(time_t)s, (suseconds_t)((s - (double)(time_t)s) * 1e6)};
    setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv);
}

__attribute__((noreturn)) static void connection_error(const char *fmt, ...)
{
    char text[1000], msg[1100];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    snprintf(msg, sizeof msg, "ConnectionError: %s", text);
    fail(EXIT_FAILED, msg);
}

/* The node's probe (with the node folder): while rank 0's store is not listening, one rank of the
 * node at a time tries it (the holder of the node's lock, backing off to PROBE_CAP_S), the others
 * wait for that rank to get through and then try all at once: a node's refused tries cost what one
 * rank's did, so its pause can be a quarter as long. */
static void on_alarm(int sig) { (void)sig; }

static int probe_open(char *name, size_t size)
{
    snprintf(name, size, "rendezvous-%lld.lock", R.incarnation);
    return openat(R.relay->fd, name, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
}

/* Waits for the node's prober at most about `seconds`: 1 when the lock is free (it got through, or
 * is gone), 0 when it still tries (beat and wait again). Shared: every rank waiting goes at once. */
static int probe_wait(int fd, double seconds)
{
    struct sigaction sa = {.sa_handler = on_alarm};   /* no SA_RESTART: the alarm ends flock's wait */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGALRM, &sa, NULL);
    struct timeval every = {(time_t)seconds, (suseconds_t)((seconds - (double)(time_t)seconds) * 1e6)};
    struct itimerval t = {every, every}, off = {{0, 0}, {0, 0}};   /* again and again: one before flock is no loss */
    setitimer(ITIMER_REAL, &t, NULL);
    int rc = flock(fd, LOCK_SH);
    setitimer(ITIMER_REAL, &off, NULL);
    if (rc == 0)
        flock(fd, LOCK_UN);
    return rc == 0;
}

static long long join_store(const long long *mine, int n, double timeout_s)
{
    double deadline = mono_s() + timeout_s, pause = 0.05;
    unsigned seed = (unsigned)getpid() ^ (unsigned)(now_s() * 1e6);
    char probe_name[64];
    int probe = -1, probed = 0, holding = 0, tries = 0;
    struct buf hello = {0};
    buf_fmt(&hello, "%lld ", R.rank);
    for (int i = 0; i < n; i++)
        buf_fmt(&hello, i ? ",%lld" : "%lld", mine[i]);
    buf_str(&hello, n ? "\n" : "-\n");
    for (;;) {
        /* the first try alone (a rank that starts once the store listens touches no lock); refused,
         * the node's probe */
        if (tries++ > 0 && R.relay && !probed) {
            probed = 1;
            probe = probe_open(probe_name, sizeof probe_name);
        }
        if (probe >= 0 && !holding) {
            if (flock(probe, LOCK_EX | LOCK_NB) == 0) {
                holding = 1;   /* this rank tries for the node */
            } else if (!probe_wait(probe, R.interval / 2)) {   /* another one tries: wait for it */
                if (mono_s() > deadline)
                    connection_error("couldn't reach the store at %s:%lld: timed out", R.master, R.port);
                beat(0, 0);
                continue;
            }
        }
        int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa;
        char data[256];
        size_t got = 0;
        if (s < 0) {
            os_fail("socket");
            goto again;
        }
        if (master_addr(&sa, 0) < 0)
            goto again;
        set_timeout(s, SO_SNDTIMEO, 5);
        if (connect(s, (struct sockaddr *)&sa, sizeof sa) < 0) {
            if (errno == EINPROGRESS || errno == EAGAIN)
                snprintf(oserr, sizeof oserr, "timed out");
            else
                snprintf(oserr, sizeof oserr, "[Errno %d] %s", errno, strerror(errno));
            goto again;
        }
        if (probe >= 0) {   /* through: the ranks waiting go now; the prober leaves no file */
            if (holding)
                unlinkat(R.relay->fd, probe_name, 0);
            close(probe);
            probe = -1;
            holding = 0;
        }
        if (send(s, hello.p, hello.len, MSG_NOSIGNAL) != (ssize_t)hello.len) {
            snprintf(oserr, sizeof oserr, "[Errno %d] %s", errno, strerror(errno));
            goto again;
        }
        set_timeout(s, SO_RCVTIMEO, R.interval);
        while (!got || data[got - 1] != '\n') {
            ssize_t k = recv(s, data + got, sizeof data - 1 - got, 0);
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                beat(0, 0);
                if (mono_s() > deadline) {
                    snprintf(oserr, sizeof oserr, "timed out");
                    goto again;
                }
                continue;
            }
            if (k < 0) {
                snprintf(oserr, sizeof oserr, "[Errno %d] %s", errno, strerror(errno));
                goto again;
            }
            if (k == 0 || got + (size_t)k >= sizeof data - 1) {
                snprintf(oserr, sizeof oserr, "the store closed the connection");
                goto again;
            }
            got += (size_t)k;
        }
        data[got] = 0;
        close(s);
        free(hello.p);
        char *end;
        long long agreed = strtoll(data, &end, 10);
        while (*end == ' ')
            end++;
        R.start_at = *end && *end != '\n' ? strtod(end, NULL) : now_s();
        return agreed;
    again:   /* refused (rank 0 not listening yet), its backlog full, reset: again */
        if (s >= 0)
            close(s);
        if (mono_s() > deadline)
            connection_error("couldn't reach the store at %s:%lld: %s", R.master, R.port, oserr);
        beat(0, 0);
        if (tries == 1 && R.relay)   /* refused alone: to the node's probe at once */
            continue;
        /* backing off: 2,000 ranks retrying every 0.1 s while rank 0 starts were the machine's whole
         * load at 512 nodes; the jitter drawn anew each time (one fixed per process kept a rank's
         * tries in the same phase as its neighbours'), so that they do not come back together */
        sleep_s(pause * (0.5 + (double)rand_r(&seed) / RAND_MAX));
        double cap = probe >= 0 ? PROBE_CAP_S : BACKOFF_CAP_S;
        pause = pause * 2 < cap ? pause * 2 : cap;
    }
}

/* Rank 0's store: open (listening) before rank 0 reads its markers, so that a rank that starts
 * meanwhile is queued by the kernel, not refused into a back-off. */
static struct {
    int fd;
    double listening_at;
} store = {-1, 0};

/* A socket listening on MASTER_PORT, or -1 with oserr and *stage set (0: the socket, 1: the address,
 * 2: bind or listen). */
static int store_listen(int *stage)
{
    int server = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), one = 1;
    struct sockaddr_in sa;
    *stage = 0;
    if (server < 0 || setsockopt(server, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0) {
        snprintf(oserr, sizeof oserr, "%s", strerror(errno));
        goto fail;
    }
    *stage = 1;
    if (master_addr(&sa, 1) < 0)
        goto fail;
    *stage = 2;
    if (bind(server, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(server, R.world < 4096 ? (int)R.world : 4096) < 0) {
        snprintf(oserr, sizeof oserr, "[Errno %d] %s", errno, strerror(errno));
        goto fail;
    }
    store.listening_at = now_s();
    return server;
fail:
    if (server >= 0)
        close(server);
    return -1;
}

/* The store as soon as the process runs, before its cgroup join and setup (the join waits on the
 * kernel for milliseconds, longer while the launch forks), when the environment says rank 0 of
 * several; when it cannot, run() opens it again and says why. */
static void open_store_early(void)
{
    long long procid;
    int stage;
    if (env_int("SLURM_PROCID", 0, &procid) && env_int("RANK", procid, &R.rank) && env_int("WORLD_SIZE", 1, &R.world) &&
        env_int("MASTER_PORT", 0, &R.port) && R.rank == 0 && R.world > 1 && R.port > 0 && R.port <= 65535 &&
        (R.master = env_or("MASTER_ADDR", ""))[0])
        store.fd = store_listen(&stage);
    bad_env[0] = 0;   /* setup() reads the environment again and says what is wrong */
}

static void open_store(void)
{
    int stage;
    if (store.fd >= 0 || (store.fd = store_listen(&stage)) >= 0)
        return;
    if (stage == 0)
        connection_error("couldn't open the store: %s", oserr);
    if (stage == 1)
        connection_error("couldn't resolve %s: %s", R.master, oserr);
    char msg[1300];
    snprintf(msg, sizeof msg, "OSError: %s", oserr);
    fail(EXIT_FAILED, msg);
}

struct peer {
    int fd;
    struct buf data;
};

/* A peer's "<rank> <step>,<step>|-" line taken into held; 0 when it is not one. */
static int take_join(const char *text, size_t len, long long **held, int *nheld, char *seen, long long *joined)
{
    char *end;
    long long rank = strtoll(text, &end, 10);
    if (end == text || *end != ' ' || rank < 0 || rank >= R.world)
        return 0;
    free(held[rank]);
    int m = 0;
    held[rank] = malloc(sizeof **held * (len / 2 + 1));
    for (char *t = end + 1; *t && *t != '\n';) {
        char *after;
        long long step = strtoll(t, &after, 10);
        if (after != t)
            held[rank][m++] = step;
        t = *after == ',' ? after + 1 : after == t ? t + 1 : after;
    }
    nheld[rank] = m;
    if (!seen[rank]) {
        seen[rank] = 1;
        (*joined)++;
    }
    return 1;
}

/* Every rank's join, then one answer to each. A join is read as its connection is accepted (a peer
 * sends it as soon as it is connected) and only the peers whose line is not complete yet are
 * polled: a wake-up costs what is ready, not every rank that joined before it. */
static long long serve_store(const long long *mine, int n, double timeout_s)
{
    long long world = R.world;
    /* a descriptor per peer until the answer: 2,047 at 512 nodes, over a soft limit of 1,024 */
    struct rlimit nofile;
    if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur < (rlim_t)world + 64) {
        nofile.rlim_cur = nofile.rlim_max == RLIM_INFINITY || nofile.rlim_max > (rlim_t)world + 64
                              ? (rlim_t)world + 64 : nofile.rlim_max;
        setrlimit(RLIMIT_NOFILE, &nofile);
    }
    long long **held = calloc((size_t)world, sizeof *held);
    int *nheld = calloc((size_t)world, sizeof *nheld);
    char *seen = calloc((size_t)world, 1);
    held[0] = malloc(sizeof **held * (size_t)(n + 1));
    memcpy(held[0], mine, sizeof *mine * (size_t)n);
    nheld[0] = n;
    seen[0] = 1;
    long long joined = 1;
    size_t cap = 64, count = 1;   /* pfd[0]: the store; pfd[1..count): the peers still sending */
    struct pollfd *pfd = calloc(cap, sizeof *pfd);
    struct peer *peers = calloc(cap, sizeof *peers);
    pfd[0] = (struct pollfd){.fd = store.fd, .events = POLLIN};
    size_t ndone = 0, done_cap = 64;   /* a rank that retried after a reset answers twice */
    int *done = calloc(done_cap, sizeof *done);
    long long wakes = 0;
    double deadline = mono_s() + timeout_s;
    while (joined < world) {
        if (mono_s() > deadline)
            connection_error("%lld of %lld ranks joined within %.0fs", joined, world, timeout_s);
        beat(0, 0);
        int ready = poll(pfd, count, (int)((R.interval < 0.5 ? R.interval : 0.5) * 1000));
        if (ready <= 0)
            continue;
        wakes++;
        size_t first_new = count;
        if (pfd[0].revents) {
            for (;;) {   /* every connection waiting, not one per wake-up */
                int c = accept4(store.fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
                if (c < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED))
                    break;
                if (c < 0)   /* out of descriptors: said, not a busy loop till the deadline */
                    connection_error("couldn't accept a peer (%lld of %lld joined): %s", joined, world,
                                     strerror(errno));
                if (count == cap) {
                    cap *= 2;
                    pfd = realloc(pfd, cap * sizeof *pfd);
                    peers = realloc(peers, cap * sizeof *peers);
                }
                pfd[count] = (struct pollfd){.fd = c, .events = POLLIN, .revents = POLLIN};
                peers[count] = (struct peer){.fd = c};
                count++;
            }
        }
        for (size_t i = count; i-- > 1;) {   /* backwards: a finished peer's slot takes the last one */
            if (!pfd[i].revents && i < first_new)
                continue;
            struct peer *p = &peers[i];
            char chunk[4096];
            ssize_t k = recv(p->fd, chunk, sizeof chunk, 0);
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
                continue;
            if (k > 0)
                buf_add(&p->data, chunk, (size_t)k);
            if (k > 0 && p->data.p[p->data.len - 1] != '\n')
                continue;
            char *text = p->data.p ? p->data.p : "";
            if (!take_join(text, p->data.len, held, nheld, seen, &joined)) {
                close(p->fd);
                connection_error("a peer sent %.60s (expected '<rank> <steps>')", text);
            }
            free(p->data.p);
            if (ndone == done_cap)
                done = realloc(done, (done_cap *= 2) * sizeof *done);
            done[ndone++] = p->fd;
            count--;
            pfd[i] = pfd[count];
            peers[i] = peers[count];
        }
    }
    double joined_at = now_s();
    long long agreed = -1;
    int any = 0;
    for (long long r = 0; r < world; r++)
        any |= nheld[r] > 0;
    for (int i = 0; i < nheld[0]; i++) {   /* the newest step in every rank's markers */
        long long step = held[0][i];
        int everywhere = 1;
        for (long long r = 1; r < world && everywhere; r++) {
            everywhere = 0;
            for (int k = 0; k < nheld[r] && !everywhere; k++)
                everywhere = held[r][k] == step;
        }
        if (everywhere && step > agreed)
            agreed = step;
    }
    if (agreed < 0)
        agreed = any ? -1 : 0;
    /* the life's start: every rank steps on this clock (a collective keeps real ranks in step) */
    R.start_at = now_s();
    struct buf answer = {0};
    buf_fmt(&answer, "%lld ", agreed);
    put_float(&answer, R.start_at, 0);
    buf_str(&answer, "\n");
    for (size_t i = 0; i < ndone; i++) {
        fcntl(done[i], F_SETFL, fcntl(done[i], F_GETFL) & ~O_NONBLOCK);
        send(done[i], answer.p, answer.len, MSG_NOSIGNAL);   /* a rank gone: the step ends without it */
        close(done[i]);
    }
    for (size_t i = 1; i < count; i++)
        close(pfd[i].fd);
    close(store.fd);
    store.fd = -1;
    /* what the scale bench splits the rendezvous with (bench/scale_bench.py, STORE_LINE) */
    struct buf said = {0};
    buf_str(&said, "light rank 0: store listening at ");
    put_float(&said, store.listening_at, 0);
    buf_str(&said, ", every join at ");
    put_float(&said, joined_at, 0);
    buf_fmt(&said, " (%lld ranks, %lld wake-ups)\n", world, wakes);
    write_all(2, said.p, said.len);
    for (long long r = 0; r < world; r++)
        free(held[r]);
    free(held);
    free(nheld);
    free(seen);
    free(done);
    free(pfd);
    free(peers);
    free(answer.p);
    free(said.p);
    return agreed;
}

/* The newest step in every rank's markers (0: none anywhere, a fresh start; -1: markers but no
 * step in common). */
static long long agree(const long long *mine, int n, double timeout_s)
{
    if (R.world == 1)
        return n ? mine[n - 1] : 0;
    return R.rank == 0 ? serve_store(mine, n, timeout_s) : join_store(mine, n, timeout_s);
}

/* -- the run ------------------------------------------------------------------------------------ */
static int finish(int code, const char *phase, const char *error)
{
    R.finishing = 1;
    signal(SIGUSR1, SIG_IGN);   /* the code is decided */
    signal(SIGTERM, SIG_IGN);
    if (error && error[0]) {   /* " ".join(error.split())[:MAX_ERROR_CHARS] */
        struct buf b = {0};
        buf_str(&b, "");
        for (const char *s = error; *s;) {
            while (*s && (strchr(" \t\n\r\v\f", *s) || (*s >= 0x1c && *s <= 0x1f)))
                s++;
            const char *w = s;
            while (*s && !(strchr(" \t\n\r\v\f", *s) || (*s >= 0x1c && *s <= 0x1f)))
                s++;
            if (s > w) {
                if (b.len)
                    buf_str(&b, " ");
                buf_add(&b, w, (size_t)(s - w));
            }
        }
        free(R.error);
        R.error = head(b.p, MAX_ERROR_CHARS);
        free(b.p);
    }
    R.phase = phase;
    R.has_exit = 1;
    R.exit_code = code;
    beat(1, 1);
    if (R.metrics_fd >= 0) {
        if (R.node_lines)
            relay_close_lines(R.relay, R.metrics_fd);
        close(R.metrics_fd);
    }
    return code;
}

static void pace(double seconds)   /* sleeping till the next step, beating meanwhile */
{
    double end = mono_s() + seconds, wake = R.relay ? R.interval / 2 : R.interval, left;
    while ((left = end - mono_s()) > 0) {
        sleep_s(left < wake ? left : wake);
        beat(0, 0);
    }
}

/* The last step from the finish time, once the file is there (light_rank.py's text): the first step
 * of this life due at or after it, or step when that one is past. */
static void read_finish(long long step, long long agreed, double start_at)
{
    int fd = open(R.finish_file, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return;
        os_fail(R.finish_file);
        crash_os();
    }
    char data[65];
    ssize_t n = read(fd, data, 64);
    close(fd);
    if (n < 0) {
        os_fail(R.finish_file);
        crash_os();
    }
    data[n] = 0;
    const char *text;
    size_t len;
    strip(data, &text, &len);
    char *t = strndup(text, len), *end = NULL;
    double at = len ? strtod(t, &end) : 0.0;
    if (!len || *end || !isfinite(at)) {
        struct buf msg = {0};
        char *h = head(t, 40);
        buf_fmt(&msg, "light rank: couldn't read a finish time in %s: ", R.finish_file);
        put_repr(&msg, h);
        buf_str(&msg, len && !*end ? " is not a finite number (seconds since the epoch)"
                                   : " is not a number (seconds since the epoch)");
        fail(EXIT_BAD_INPUT, msg.p);
    }
    free(t);
    double x = (at - start_at) / R.step_delay;   /* ceil(x), without libm; a step count fits in 1e15 */
    x = x > 1e15 ? 1e15 : x < -1e15 ? -1e15 : x;
    long long due = (long long)x;
    due += (double)due < x;
    due += agreed;
    long long last = due > step ? due : step;
    R.max_steps = last < R.max_steps ? last : R.max_steps;
    R.finish_read = 1;
}

static int run(void)
{
    if (makedirs(R.hb_dir, 0700) < 0)
        crash_os();
    beat(1, 0);
    /* what the layout checks: the same numbers a real rank would refuse */
    struct buf problems = {0};
    if (R.world < 1 || !(0 <= R.rank && R.rank < R.world))
        buf_fmt(&problems, "; RANK=%lld with WORLD_SIZE=%lld", R.rank, R.world);
    if (R.dp < 1 || !(0 <= R.dp_rank && R.dp_rank < R.dp))
        buf_fmt(&problems, "; OMNI_DP_RANK=%lld with OMNI_DP_SIZE=%lld", R.dp_rank, R.dp);
    if (R.world > 1 && !(R.master[0] && R.port))
        buf_fmt(&problems, "; MASTER_ADDR and MASTER_PORT must be set for WORLD_SIZE=%lld", R.world);
    if (R.max_steps < 1 || R.every < 1 || R.interval <= 0) {
        buf_fmt(&problems, "; OMNI_MAX_STEPS=%lld, OMNI_LIGHT_CKPT_EVERY=%lld, OMNI_HEARTBEAT_INTERVAL=", R.max_steps, R.every);
        put_float(&problems, R.interval, 0);
        buf_str(&problems, " (all must be > 0)");
    }
    if (R.finish_file[0] && !(R.step_delay > 0)) {
        buf_str(&problems, "; OMNI_LIGHT_FINISH_FILE with OMNI_STEP_DELAY_S=");
        put_float(&problems, R.step_delay, 0);
        buf_str(&problems, " (a finish time needs a pace > 0: it names the step due at it)");
    }
    if (!one_of(R.per_node, PER_NODE_ANY)) {
        char *h = head(R.per_node, 40);
        buf_str(&problems, "; OMNI_METRICS_PER_NODE=");
        put_repr(&problems, h);
        buf_str(&problems, " (allowed: 1, on, true, yes or unset: per node; 0, off, false, no: each rank's own file)");
        free(h);
    }
    if (problems.len) {
        struct buf msg = {0};
        buf_fmt(&msg, "light rank: couldn't place rank: %s", problems.p + 2);
        fail(EXIT_BAD_INPUT, msg.p);
    }
    if (R.rank == 0 && R.world > 1)
        open_store();
    long long *held;
    int nheld = markers(&held);
    double timeout_s;
    if (!env_float("OMNI_COLLECTIVE_TIMEOUT", 300.0, &timeout_s))
        fail(EXIT_BAD_INPUT, bad_env);
    long long agreed = agree(held, nheld, timeout_s);
    double groups_ready_at = now_s();
    char *agreed_path = agreed > 0 ? marker_path(agreed) : NULL;
    if (agreed < 0 || (agreed_path && access(agreed_path, F_OK) < 0)) {
        struct buf msg = {0};
        buf_fmt(&msg, "light rank: couldn't restore: no step every rank holds a marker of (rank %lld holds [", R.rank);
        for (int i = nheld > 5 ? nheld - 5 : 0; i < nheld; i++)
            buf_fmt(&msg, i > (nheld > 5 ? nheld - 5 : 0) ? ", %lld" : "%lld", held[i]);
        buf_fmt(&msg, "] in %s)", R.mine);
        fail(EXIT_BAD_INPUT, msg.p);
    }
    free(agreed_path);
    free(held);
    prune(agreed);
    long long step = agreed;
    R.step = step;
    R.phase = "training";
    R.has_last_ckpt = agreed != 0;
    R.last_ckpt = agreed;
    beat(1, 0);
    struct first first = {1, R.started_at, groups_ready_at, now_s(), agreed};
    double started = now_s(), start_at = R.start_at ? R.start_at : started;
    if (R.finish_file[0])
        read_finish(step, agreed, start_at);
    while (step < R.max_steps) {
        if (blocked) {   /* in a collective that never returns: beat, never step, until told to stop */
            while (!stop_signal) {
                sleep_s(R.interval);
                beat(0, 0);
            }
            char msg[200];
            snprintf(msg, sizeof msg, "stopped at step %lld inside a collective that never returned", step);
            return finish(EXIT_FAILED, "failed", msg);
        }
        pace(start_at + (double)(step + 1 - agreed) * R.step_delay - now_s());
        step++;
        double now = now_s(), took = now - started;
        started = now;
        R.step = step;
        R.has_step_time = 1;
        R.step_time = took;
        beat(0, 0);
        log_metrics(step, took, &first);
        first.set = 0;
        if (R.finish_file[0] && !R.finish_read)
            read_finish(step, agreed, start_at);
        if (stop_signal) {
            save(step);
            return finish(EXIT_CHECKPOINTED, "stopping", NULL);
        }
        if (step % R.every == 0 || step == R.max_steps)
            save(step);
    }
    return finish(EXIT_DONE, "done", NULL);
}

/* Into OMNI_LIGHT_CGROUP (a cgroup folder), if set: a failure is said once and the rank runs on. */
static void join_cgroup(void)
{
    const char *folder = env_get("OMNI_LIGHT_CGROUP");
    if (!folder || !folder[0])
        return;
    char *path = join(folder, "cgroup.procs"), pid[24];
    int n = snprintf(pid, sizeof pid, "%d", (int)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0 || write_all(fd, pid, (size_t)n) < 0) {
        os_fail(path);
        fprintf(stderr, "light rank: couldn't join the cgroup %s: %s\n", folder, oserr);
    }
    if (fd >= 0)
        close(fd);
    free(path);
}

int main(void)
{
    R.started_at = now_s();
    signal(SIGPIPE, SIG_IGN);   /* as Python: a write to a closed socket is an error, not a death */
    open_store_early();
    join_cgroup();
    if (!setup()) {
        fprintf(stderr, "%s\n", bad_env);
        return EXIT_BAD_INPUT;
    }
    struct sigaction sa = {.sa_handler = on_signal, .sa_flags = SA_RESTART};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sa.sa_handler = on_block;
    sigaction(BLOCK_SIGNAL, &sa, NULL);
    return run();
}
