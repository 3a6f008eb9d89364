/* Job script context (slurmd's `slurmstepd spank epilog`, as root, on every node at the job's end). */
#ifndef OMNI_SPANK_EPILOG_H
#define OMNI_SPANK_EPILOG_H

#include <slurm/spank.h>

#include "args.h"

int omni_job_epilog(spank_t sp, const struct omni_config *cfg);

#endif
