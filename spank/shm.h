/* The job's objects in node-local shared memory, removed at the job's end (slurm_spank_job_epilog):
 *
 *   <dir>/omni-beats-<uid>-<job>-<node>/   heartbeats of the job's ranks on <node> (elastic/heartbeat.py)
 *   <dir>/omni-<uid>/<job>/                 the memory tier's copies, <job>/peer/ a peer's (checkpoint/memtier.py)
 *
 * The epilog runs as root over folders the job's user controls, so nothing is trusted by path: <dir>
 * is opened once, every object relative to it with O_NOFOLLOW|O_DIRECTORY and kept only when fstat
 * says it is a folder of the job's uid; its entries are unlinked relative to that descriptor, and a
 * folder inside it is entered the same way (one level: peer/). A symlink, another user's folder with
 * a matching name, or an entry another uid owns is left where it is. The removals run with the
 * owner's file-system uid and gid (setfsuid/setfsgid, this thread only, no fork): in the sticky
 * /dev/shm the kernel then refuses to remove a name another user put in place of the one checked
 * (a rename between the check and the rmdir). No Slurm calls, no fork, no lock:
 * tests/spank/harness.c builds this file alone. */
#ifndef OMNI_SPANK_SHM_H
#define OMNI_SPANK_SHM_H

#include <stddef.h>
#include <sys/types.h>

#define OMNI_SHM_PART_MAX 65 /* a name piece as the Python side writes it: 64 characters */

struct omni_shm_job {
	uid_t uid;            /* the job's owner: every removal runs with its file-system uid/gid (setfsuid) */
	gid_t gid;
	const char *ids[2];   /* the job's ids: its own, and a het job's leader (what its tasks see); NULL: none */
	const char *node;     /* the node the epilog runs for (SLURMD_NODENAME) */
	int whole_job;        /* 1: the job ends on every node now; 0: only on this one (or not known) */
};

struct omni_shm_result {
	int removed;          /* folders removed */
	long long bytes;      /* bytes of the files unlinked */
	int kept;             /* objects with a matching name left alone (a link, not the uid's, not empty) */
	char first_kept[256]; /* the first of those, and why */
};

/* text as a piece of a file name: what is not [A-Za-z0-9_.-] becomes '_', at most 64 characters
 * (formats.safe_name and heartbeat._safe on the Python side). */
void omni_shm_safe(const char *text, char *out, size_t outlen);

/* pattern (a memory_dir) with each "%n" replaced by the node's name as omni_shm_safe writes it
 * (memtier.base_from_env); -1 when it does not fit in out. */
int omni_shm_expand_node(const char *pattern, const char *node, char *out, size_t outlen);

/* 1 when a Slurm host list names more than one host ("n1,n2", "node[1-3]"), 0 for one. */
int omni_hostlist_many(const char *hostlist);

/* 1 when name is the heartbeat folder of one of the job's ids on node (node NULL: on any node). */
int omni_shm_beats_name(const struct omni_shm_job *job, const char *name, const char *node);

/* Removes this node's heartbeat folder of the job from dir, and with whole_job every other node's
 * too (one /dev/shm shared by several slurmd, as `slurmd -N` runs them: a node lost mid-job runs no
 * epilog for it). *others: the job's heartbeat folders of other nodes left in dir (nodes of the job
 * still running on this host). 0, or -1 with one line in err when dir cannot be used (missing: 0). */
int omni_shm_clean_beats(const char *dir, const struct omni_shm_job *job, int *others, struct omni_shm_result *res,
			 char *err, size_t errlen);

/* Whether the memory tier's job folder goes now: the whole job ends, or its folder is this node's
 * alone (a memory_dir naming the node, or no other node of the job left on this host's /dev/shm). */
int omni_shm_memtier_due(int whole_job, int per_node_dir, int other_beats_left);

/* Removes dir/omni-<uid>/<id>/ (with its peer/ folder) for each of the job's ids; dir/omni-<uid>/
 * (the user's, empty) stays. Same return as omni_shm_clean_beats. */
int omni_shm_clean_memtier(const char *dir, const struct omni_shm_job *job, struct omni_shm_result *res, char *err,
			   size_t errlen);

#endif
