/* Fault records: one JSON object per abnormal task exit, written into the job owner's directory of
 * the spool (<spool>/<user>/, read by that user's manager) under a temporary name, fsynced, renamed,
 * and the directory fsynced, so the manager never reads half a record. slurmstepd runs this as root:
 * the spool root and the user's directory are opened once (O_NOFOLLOW) and checked by fstat, the
 * record is created O_EXCL relative to that descriptor and handed to the user. No Slurm calls here
 * (tests/spank/harness.c builds this file alone). */
#ifndef OMNI_SPANK_FAULT_H
#define OMNI_SPANK_FAULT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "args.h"

#define OMNI_FAULT_VERSION 1
#define OMNI_NODE_MAX 256
#define OMNI_USER_MAX 64

/* The job's owner: the records go into <spool>/<name>, owned by uid:gid. */
struct omni_owner {
	uid_t uid;
	gid_t gid;
	const char *name;
};

struct omni_fault {
	uint32_t job_id;      /* this component's job id */
	long het_job_id;      /* leader's job id, -1 for an ordinary job */
	long het_offset;      /* -1 for an ordinary job */
	uint32_t step_id;
	char node[OMNI_NODE_MAX];
	char stage[OMNI_NAME_MAX]; /* empty: unknown */
	long stage_index;     /* stage's place in --omni-stage (= het offset in a het step), -1: unknown */
	long stage_rank;      /* rank inside the stage, -1: unknown */
	long task_id;         /* task id in the step; per component in a het step (Slurm's S_TASK_GLOBAL_ID) */
	long local_task_id;   /* task id on this node */
	long pid;
	int status;           /* wait(2) status */
	struct timespec time; /* CLOCK_REALTIME when slurmstepd reaped the task */
};

/* Formats the record into buf; -1 if it does not fit. */
int omni_fault_format(const struct omni_fault *f, char *buf, size_t len);

/* Writes the record atomically into dir/<owner name>/ (made 0700 for the owner when missing); path
 * gets the final file name. */
int omni_fault_write(const char *dir, const struct omni_owner *owner, const struct omni_fault *f, char *path,
		     size_t pathlen, char *err, size_t errlen);

#endif
