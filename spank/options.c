#include "options.h"

#include <string.h>

struct omni_options omni_opts = {.stage_set = -1, .ckpt_set = -1};

static int cb_stage(int val, const char *optarg, int remote);
static int cb_ckpt(int val, const char *optarg, int remote);

static struct spank_option spank_opts[] = {
	{"omni-stage", "NAME[:N][,...]",
	 "slurm-omni: pipeline stage of each heterogeneous component (in group order), or of each "
	 "N-task block of an ordinary step; exported to tasks as OMNI_STAGE (index), OMNI_STAGE_NAME, "
	 "OMNI_STAGE_RANK, OMNI_STAGE_SIZE",
	 1, 0, cb_stage},
	{"omni-ckpt", "PATH",
	 "slurm-omni: absolute checkpoint directory of the job on shared storage; exported as OMNI_CKPT_DIR",
	 1, 0, cb_ckpt},
	SPANK_OPTIONS_TABLE_END,
};

static int cb_stage(int val, const char *optarg, int remote)
{
	char err[OMNI_ERR_MAX];

	(void)val;
	(void)remote;
	if (omni_parse_stages(optarg, &omni_opts.stages, err, sizeof(err)) < 0) {
		slurm_error("omni: --omni-stage: %s", err);
		return -1;
	}
	omni_opts.stage_set = 1;
	return 0;
}

static int cb_ckpt(int val, const char *optarg, int remote)
{
	char err[OMNI_ERR_MAX];

	(void)val;
	(void)remote;
	if (omni_check_path("--omni-ckpt", optarg, err, sizeof(err)) < 0) {
		slurm_error("omni: %s", err);
		return -1;
	}
	/* omni_check_path bounded the length below PATH_MAX */
	memcpy(omni_opts.ckpt, optarg, strlen(optarg) + 1);
	omni_opts.ckpt_set = 1;
	return 0;
}

int omni_register_options(spank_t sp)
{
	for (struct spank_option *opt = spank_opts; opt->name != NULL; opt++) {
		spank_err_t rc = spank_option_register(sp, opt);

		if (rc != ESPANK_SUCCESS) {
			slurm_error("omni: couldn't register --%s: %s", opt->name, spank_strerror(rc));
			return -1;
		}
	}
	return 0;
}
