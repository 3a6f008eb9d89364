/* Remote context (slurmstepd): the task environment and the fault records. */
#ifndef OMNI_SPANK_REMOTE_H
#define OMNI_SPANK_REMOTE_H

#include <slurm/spank.h>

#include "args.h"

int omni_remote_task_init(spank_t sp);
int omni_remote_task_exit(spank_t sp, const struct omni_config *cfg);

#endif
