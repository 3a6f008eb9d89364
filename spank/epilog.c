#include "epilog.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shm.h"

#define SHM_DIR "/dev/shm"

static int memtier(const char *dir, const struct omni_shm_job *job, struct omni_shm_result *res)
{
	char err[OMNI_ERR_MAX];

	if (omni_shm_clean_memtier(dir, job, res, err, sizeof(err)) < 0) {
		slurm_error("omni: job_epilog: %s", err);
		return -1;
	}
	return 0;
}

int omni_job_epilog(spank_t sp, const struct omni_config *cfg)
{
	struct omni_shm_result res;
	struct omni_shm_job job;
	char err[OMNI_ERR_MAX];
	char id[24];
	char dir[PATH_MAX];
	const char *het = getenv("SLURM_HET_JOB_ID");
	const char *nodes = getenv("SLURM_NODELIST");
	uint32_t job_id = 0;
	int others = 0;
	int rc = 0;

	memset(&job, 0, sizeof(job));
	memset(&res, 0, sizeof(res));
	if (spank_get_item(sp, S_JOB_UID, &job.uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_GID, &job.gid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS) {
		slurm_error("omni: job_epilog: couldn't read the job's id, uid and gid");
		return -1;
	}
	job.node = getenv("SLURMD_NODENAME");
	if (job.node == NULL || job.node[0] == '\0') {
		slurm_error("omni: job_epilog: couldn't read SLURMD_NODENAME: nothing removed");
		return -1;
	}
	snprintf(id, sizeof(id), "%u", job_id);
	job.ids[0] = id;
	/* a het job's tasks name the job by its leader's id (their SLURM_JOB_ID) */
	job.ids[1] = (het != NULL && strcmp(het, id) != 0) ? het : NULL;
	/* SLURM_NODELIST: the nodes this end covers. The job's end names all of them; a node taken out
	 * of a running job (a shrink) is told alone. A het job's components end together (Slurm 22.05
	 * neither excises nor shrinks them). */
	job.whole_job = het != NULL || (nodes != NULL && omni_hostlist_many(nodes));
	if (omni_shm_clean_beats(SHM_DIR, &job, &others, &res, err, sizeof(err)) < 0) {
		slurm_error("omni: job_epilog: %s", err);
		return -1;
	}
	if (omni_shm_memtier_due(job.whole_job, 0, others))
		rc |= memtier(SHM_DIR, &job, &res);
	if (cfg->memory_dir[0] != '\0') {
		if (omni_shm_expand_node(cfg->memory_dir, job.node, dir, sizeof(dir)) < 0) {
			slurm_error("omni: job_epilog: memory_dir=%s: too long with the node's name", cfg->memory_dir);
			rc = -1;
		} else if (omni_shm_memtier_due(job.whole_job, strstr(cfg->memory_dir, "%n") != NULL, others)) {
			rc |= memtier(dir, &job, &res);
		}
	}
	if (res.removed > 0 || res.kept > 0)
		slurm_info("omni: job_epilog: job %s (uid %lu) on %s: removed %d shared-memory folders (%lld bytes)%s%s%s",
			   id, (unsigned long)job.uid, job.node, res.removed, res.bytes, res.kept ? "; left " : "",
			   res.first_kept, res.kept > 1 ? " and more" : "");
	return rc;
}
