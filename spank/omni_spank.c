/* slurm-omni SPANK plugin: every exported hook, dispatched by context.
 *
 * plugstack.conf:  optional /path/to/omni_spank.so spool=/var/spool/slurm-omni
 */
#include <slurm/spank.h>

#include "args.h"
#include "epilog.h"
#include "options.h"
#include "remote.h"

SPANK_PLUGIN(omni, 1);

static struct omni_config config;

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	char err[OMNI_ERR_MAX];

	if (omni_parse_config(ac, av, &config, err, sizeof(err)) < 0) {
		slurm_error("omni: plugstack.conf: %s", err);
		return -1;
	}
	/* Options must be registered in every context that parses them (local, remote, allocator). */
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_REMOTE:
	case S_CTX_ALLOCATOR:
		return omni_register_options(sp);
	default:
		return 0;
	}
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return omni_remote_task_init(sp);
}

int slurm_spank_task_exit(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	/* A failed record must not fail the step: the manager still has the job state. */
	(void)omni_remote_task_exit(sp, &config);
	return 0;
}

/* slurmd runs this as root on each node the job ends on (also the nodes of a job cancelled or
 * killed, whatever killed its processes): the job's shared-memory objects there go. File work only. */
int slurm_spank_job_epilog(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (spank_context() != S_CTX_JOB_SCRIPT)
		return 0;
	/* A leftover must not drain the node (a failing epilog does): it is logged, and the job ends. */
	(void)omni_job_epilog(sp, &config);
	return 0;
}
