/* Drives the plugin's pure parts (args.c, fault.c) from the command line for tests/spank. */
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "args.h"
#include "fault.h"
#include "shm.h"

static int usage(void)
{
	fprintf(stderr, "usage: harness stages ARG | path ARG | config ARGS... | "
			"place STAGES HET_OFFSET COMP_RANK COMP_SIZE RANK SIZE | fault DIR USER NODE STAGE STATUS | "
			"expand PATTERN NODE | hostlist LIST | beats-name UID ID HET_ID NAME [NODE] | "
			"shm-clean DIR UID GID NODE WHOLE_JOB ID [HET_ID] | memtier-due WHOLE_JOB PER_NODE OTHERS\n");
	return 2;
}

int main(int argc, char **argv)
{
	char err[OMNI_ERR_MAX] = "";

	if (argc < 2)
		return usage();
	if (strcmp(argv[1], "stages") == 0 && argc == 3) {
		struct omni_stage_list l;

		if (omni_parse_stages(argv[2], &l, err, sizeof(err)) < 0)
			goto fail;
		for (int i = 0; i < l.count; i++)
			printf("%s %ld\n", l.stages[i].name, l.stages[i].ntasks);
		return 0;
	}
	if (strcmp(argv[1], "path") == 0 && argc == 3) {
		if (omni_check_path("--omni-ckpt", argv[2], err, sizeof(err)) < 0)
			goto fail;
		return 0;
	}
	if (strcmp(argv[1], "config") == 0) {
		struct omni_config c;

		if (omni_parse_config(argc - 2, argv + 2, &c, err, sizeof(err)) < 0)
			goto fail;
		printf("spool=%s\n", c.spool);
		if (c.memory_dir[0] != '\0')
			printf("memory_dir=%s\n", c.memory_dir);
		return 0;
	}
	if (strcmp(argv[1], "place") == 0 && argc == 8) {
		struct omni_stage_list l;
		struct omni_placement p;

		if (omni_parse_stages(argv[2], &l, err, sizeof(err)) < 0 ||
		    omni_place(&l, atol(argv[3]), atol(argv[4]), atol(argv[5]), atol(argv[6]), atol(argv[7]), &p,
			       err, sizeof(err)) < 0)
			goto fail;
		printf("%s %ld %ld\n", l.stages[p.stage].name, p.stage_rank, p.stage_size);
		return 0;
	}
	if (strcmp(argv[1], "fault") == 0 && argc == 7) {
		struct omni_fault f;
		struct omni_owner owner;
		struct passwd *pw = getpwnam(argv[3]);
		char path[PATH_MAX];

		if (pw == NULL) {
			snprintf(err, sizeof(err), "no user %s", argv[3]);
			goto fail;
		}
		owner.uid = pw->pw_uid;
		owner.gid = pw->pw_gid;
		owner.name = argv[3];

		memset(&f, 0, sizeof(f));
		f.job_id = 42;
		f.het_job_id = 41;
		f.het_offset = 1;
		f.step_id = 0;
		snprintf(f.node, sizeof(f.node), "%s", argv[4]);
		snprintf(f.stage, sizeof(f.stage), "%s", argv[5]);
		f.stage_index = 1;
		f.stage_rank = 3;
		f.task_id = 3;
		f.local_task_id = 1;
		f.pid = 1234;
		f.status = atoi(argv[6]);
		f.time.tv_sec = 1700000000;
		f.time.tv_nsec = 5000000;
		if (omni_fault_write(argv[2], &owner, &f, path, sizeof(path), err, sizeof(err)) < 0)
			goto fail;
		printf("%s\n", path);
		return 0;
	}
	if (strcmp(argv[1], "expand") == 0 && argc == 4) {
		char out[64];

		if (omni_shm_expand_node(argv[2], argv[3], out, sizeof(out)) < 0) {
			snprintf(err, sizeof(err), "too long");
			goto fail;
		}
		printf("%s\n", out);
		return 0;
	}
	if (strcmp(argv[1], "hostlist") == 0 && argc == 3) {
		printf("%d\n", omni_hostlist_many(argv[2]));
		return 0;
	}
	if (strcmp(argv[1], "beats-name") == 0 && (argc == 6 || argc == 7)) {
		struct omni_shm_job job = {.uid = (uid_t)atol(argv[2]), .ids = {argv[3], argv[4]}};

		printf("%d\n", omni_shm_beats_name(&job, argv[5], argc == 7 ? argv[6] : NULL));
		return 0;
	}
	if (strcmp(argv[1], "memtier-due") == 0 && argc == 5) {
		printf("%d\n", omni_shm_memtier_due(atoi(argv[2]), atoi(argv[3]), atoi(argv[4])));
		return 0;
	}
	if (strcmp(argv[1], "shm-clean") == 0 && (argc == 8 || argc == 9)) {
		/* what the epilog does for /dev/shm (spank/epilog.c), on DIR */
		struct omni_shm_job job = {.uid = (uid_t)atol(argv[3]), .gid = (gid_t)atol(argv[4]), .node = argv[5],
					   .whole_job = atoi(argv[6]), .ids = {argv[7], argc == 9 ? argv[8] : NULL}};
		struct omni_shm_result res;
		int others = 0;

		memset(&res, 0, sizeof(res));
		if (omni_shm_clean_beats(argv[2], &job, &others, &res, err, sizeof(err)) < 0)
			goto fail;
		if (omni_shm_memtier_due(job.whole_job, 0, others) &&
		    omni_shm_clean_memtier(argv[2], &job, &res, err, sizeof(err)) < 0)
			goto fail;
		printf("removed=%d bytes=%lld others=%d kept=%d %s\n", res.removed, res.bytes, others, res.kept,
		       res.first_kept);
		return 0;
	}
	return usage();
fail:
	printf("%s\n", err);
	return 1;
}
