#include "remote.h"

#include <pwd.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#include "fault.h"
#include "options.h"

#define ENV_VALUE_MAX 64

/* -1 when the variable is missing or not a number in [0, LONG_MAX]. */
static long env_long(spank_t sp, const char *name)
{
	char buf[ENV_VALUE_MAX];
	long v;

	if (spank_getenv(sp, name, buf, sizeof(buf)) != ESPANK_SUCCESS)
		return -1;
	if (omni_parse_long(buf, 0, LONG_MAX, &v) < 0)
		return -1;
	return v;
}

static int set_env(spank_t sp, const char *name, const char *value, int overwrite)
{
	spank_err_t rc = spank_setenv(sp, name, value, overwrite);

	if (rc != ESPANK_SUCCESS && rc != ESPANK_ENV_EXISTS) {
		slurm_error("omni: task_init: couldn't set %s: %s", name, spank_strerror(rc));
		return -1;
	}
	return 0;
}

static int set_env_long(spank_t sp, const char *name, long value, int overwrite)
{
	char buf[ENV_VALUE_MAX];

	snprintf(buf, sizeof(buf), "%ld", value);
	return set_env(sp, name, buf, overwrite);
}

/* The component of a heterogeneous job this slurmstepd serves; -1 in an ordinary job.
 * Slurm 22.05 exports no offset to a het step: its tasks see the leader's SLURM_JOB_ID, the
 * job's SLURM_HET_SIZE and a step-global SLURM_PROCID, while each component's slurmstepd has its
 * own job id (leader + offset) and per-component S_TASK_GLOBAL_ID / S_JOB_TOTAL_TASK_COUNT. */
static long het_offset(spank_t sp, long *leader)
{
	uint32_t job_id = 0;
	long het_size = env_long(sp, "SLURM_HET_SIZE");
	long lead = env_long(sp, "SLURM_JOB_ID");

	*leader = -1;
	if (het_size < 1 || lead < 0 || spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS)
		return -1;
	if ((long)job_id < lead || (long)job_id - lead >= het_size)
		return -1;
	*leader = lead;
	return (long)job_id - lead;
}

int omni_remote_task_init(spank_t sp)
{
	char err[OMNI_ERR_MAX];
	struct omni_placement place;
	uint32_t comp_rank = 0;
	uint32_t comp_size = 0;
	long offset;
	long leader;
	long rank;
	long size;
	long local;

	if (omni_opts.ckpt_set == 1 && set_env(sp, "OMNI_CKPT_DIR", omni_opts.ckpt, 1) < 0)
		return -1;
	if (omni_opts.stage_set != 1)
		return 0;
	rank = env_long(sp, "SLURM_PROCID");
	size = env_long(sp, "SLURM_NTASKS");
	local = env_long(sp, "SLURM_LOCALID");
	if (rank < 0 || size < 1 || local < 0) {
		slurm_error("omni: task_init: couldn't read SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID of the task");
		return -1;
	}
	offset = het_offset(sp, &leader);
	if (offset >= 0 &&
	    (spank_get_item(sp, S_TASK_GLOBAL_ID, &comp_rank) != ESPANK_SUCCESS ||
	     spank_get_item(sp, S_JOB_TOTAL_TASK_COUNT, &comp_size) != ESPANK_SUCCESS)) {
		slurm_error("omni: task_init: couldn't read the task's rank in its het component");
		return -1;
	}
	if (omni_place(&omni_opts.stages, offset, comp_rank, comp_size, rank, size, &place, err,
		       sizeof(err)) < 0) {
		slurm_error("omni: task_init: --omni-stage: %s", err);
		return -1;
	}
	/* OMNI_STAGE is the stage's index (what slurm_omni.elastic.layout reads), the name beside it */
	if (set_env_long(sp, "OMNI_STAGE", place.stage, 1) < 0 ||
	    set_env(sp, "OMNI_STAGE_NAME", omni_opts.stages.stages[place.stage].name, 1) < 0 ||
	    set_env_long(sp, "OMNI_STAGE_RANK", place.stage_rank, 1) < 0 ||
	    set_env_long(sp, "OMNI_STAGE_SIZE", place.stage_size, 1) < 0)
		return -1;
	/* torch.distributed and runtime names; a launcher that already set them wins */
	if (set_env_long(sp, "RANK", rank, 0) < 0 || set_env_long(sp, "WORLD_SIZE", size, 0) < 0 ||
	    set_env_long(sp, "LOCAL_RANK", local, 0) < 0 || set_env_long(sp, "OMNI_DP_RANK", place.stage_rank, 0) < 0)
		return -1;
	return 0;
}

/* The job's owner, whose directory of the spool gets the record. */
static int job_owner(spank_t sp, struct omni_owner *owner, char *name, size_t namelen)
{
	struct passwd pw;
	struct passwd *found = NULL;
	char buf[4096];
	int rc;

	if (spank_get_item(sp, S_JOB_UID, &owner->uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_GID, &owner->gid) != ESPANK_SUCCESS) {
		slurm_error("omni: task_exit: couldn't read the job's uid and gid");
		return -1;
	}
	rc = getpwuid_r(owner->uid, &pw, buf, sizeof(buf), &found);
	if (rc != 0 || found == NULL) {
		slurm_error("omni: task_exit: couldn't find the name of uid %ld: %s", (long)owner->uid,
			    rc ? strerror(rc) : "no such user");
		return -1;
	}
	snprintf(name, namelen, "%s", pw.pw_name);
	owner->name = name;
	return 0;
}

int omni_remote_task_exit(spank_t sp, const struct omni_config *cfg)
{
	struct omni_owner owner;
	char user[OMNI_USER_MAX + 2];
	char err[OMNI_ERR_MAX];
	char path[PATH_MAX];
	struct omni_fault f;
	struct omni_placement place;
	uint32_t global_id = 0;
	uint32_t total = 0;
	int local_id = -1;
	pid_t pid = 0;
	int status = 0;
	long offset;
	long leader;

	if (cfg->spool[0] == '\0' || omni_opts.stage_set != 1)
		return 0;
	if (spank_get_item(sp, S_TASK_EXIT_STATUS, &status) != ESPANK_SUCCESS) {
		slurm_error("omni: task_exit: couldn't read the task's exit status");
		return -1;
	}
	/* Only abnormal ends are fault signals; a clean exit says nothing the manager needs. */
	if (status == 0)
		return 0;
	memset(&f, 0, sizeof(f));
	f.stage_index = -1;
	f.stage_rank = -1;
	f.status = status;
	clock_gettime(CLOCK_REALTIME, &f.time);
	if (spank_get_item(sp, S_JOB_ID, &f.job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_STEPID, &f.step_id) != ESPANK_SUCCESS) {
		slurm_error("omni: task_exit: couldn't read the job and step id");
		return -1;
	}
	(void)spank_get_item(sp, S_TASK_GLOBAL_ID, &global_id);
	(void)spank_get_item(sp, S_TASK_ID, &local_id);
	(void)spank_get_item(sp, S_TASK_PID, &pid);
	offset = het_offset(sp, &leader);
	f.het_offset = offset;
	f.het_job_id = leader;
	f.task_id = global_id;
	f.local_task_id = local_id;
	f.pid = pid;
	if (spank_getenv(sp, "SLURMD_NODENAME", f.node, sizeof(f.node)) != ESPANK_SUCCESS)
		snprintf(f.node, sizeof(f.node), "%s", "unknown");
	if (spank_get_item(sp, S_JOB_TOTAL_TASK_COUNT, &total) == ESPANK_SUCCESS &&
	    omni_place(&omni_opts.stages, offset, global_id, total, global_id, total, &place, err,
		       sizeof(err)) == 0) {
		snprintf(f.stage, sizeof(f.stage), "%s", omni_opts.stages.stages[place.stage].name);
		f.stage_index = place.stage;
		f.stage_rank = place.stage_rank;
	}
	if (job_owner(sp, &owner, user, sizeof(user)) < 0)
		return -1;
	if (omni_fault_write(cfg->spool, &owner, &f, path, sizeof(path), err, sizeof(err)) < 0) {
		slurm_error("omni: task_exit: %s", err);
		return -1;
	}
	slurm_info("omni: task %u of job %u exited abnormally (status %d): %s", global_id, f.job_id, status, path);
	return 0;
}
