/* The plugin's options, one table, one callback each. Values live here for the whole process:
 * srun/sbatch parse them locally, slurmstepd gets them again through the job's environment. */
#ifndef OMNI_SPANK_OPTIONS_H
#define OMNI_SPANK_OPTIONS_H

#include <slurm/spank.h>

#include "args.h"

struct omni_options {
	int stage_set;    /* -1: not given */
	struct omni_stage_list stages;
	int ckpt_set;     /* -1: not given */
	char ckpt[PATH_MAX];
};

extern struct omni_options omni_opts;

int omni_register_options(spank_t sp);

#endif
