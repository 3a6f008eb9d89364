/* omni-node-read: a kept process that reads Slurm's record of one node per request, with one RPC of
 * that node's record (slurm_load_node_single) where `scontrol show node NAME` loads every node of the
 * cluster (slurm_load_node: at 512 nodes, a 512-record answer packed, sent, unpacked and searched
 * while the node loss it confirms tears the step down) and then the partitions. The partitions (for
 * the record's Partitions=, as scontrol's) come from a copy this process keeps: read at its start,
 * asked again (slurm_load_partitions with the copy's time: slurmctld answers "no change" unless an
 * admin changed them) whenever it sat idle PARTS_IDLE_MS, and before an answer when the copy is older
 * than PARTS_MAX_AGE_S, never on the way of a read that came soon after one: at 512 emulated nodes that
 * second RPC reached slurmctld 19-46 ms after the first, inside a node loss's teardown (2026-12-03 23:24).
 * Prints what scontrol prints (slurm_print_node_table).
 *
 * stdin: one request a line, "NAME" (one node, no list). stdout: the node's record, or one line
 * "error: <Slurm's message>", then the end word given as the only argument, on a line of its own. The
 * supervisor (slurm/node_read.py) writes a name and reads to the end word. Ends at EOF of stdin. */
#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define PARTS_IDLE_MS 10000
#define PARTS_MAX_AGE_S 30

static partition_info_msg_t *parts;
static time_t parts_read;

/* The partitions again (a copy that slurmctld says is current stays); 0, else Slurm's errno. */
static int refresh_parts(void)
{
	partition_info_msg_t *fresh = NULL;

	if (slurm_load_partitions(parts ? parts->last_update : 0, &fresh, 0) == SLURM_SUCCESS) {
		if (parts)
			slurm_free_partition_info_msg(parts);
		parts = fresh;
	} else if (slurm_get_errno() != SLURM_NO_CHANGE_IN_DATA) {
		return slurm_get_errno();
	}
	parts_read = time(NULL);
	return 0;
}

static int valid_name(const char *name)
{
	if (!*name)
		return 0;
	for (const char *c = name; *c; c++)
		if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') ||
		      *c == '-' || *c == '_' || *c == '.'))
			return 0;
	return 1;
}

int main(int argc, char **argv)
{
	char line[1024];
	struct pollfd in = { .fd = STDIN_FILENO, .events = POLLIN };

	if (argc != 2) {
		fprintf(stderr, "usage: omni-node-read END-WORD\n");
		return 2;
	}
	setvbuf(stdin, NULL, _IONBF, 0);	/* nothing read ahead of what poll() sees */
	slurm_init(NULL);
	refresh_parts();	/* a failure here is said by the first read's */
	/* the first line: ready (slurm.conf and the plugins loaded, the partitions read) */
	printf("%s\n", argv[1]);
	fflush(stdout);
	for (;;) {
		node_info_msg_t *nodes = NULL;
		int rc;

		rc = poll(&in, 1, PARTS_IDLE_MS);
		if (rc == 0) {
			refresh_parts();
			continue;
		}
		if (rc < 0 || !fgets(line, sizeof(line), stdin))
			break;
		line[strcspn(line, "\r\n")] = '\0';
		if (!valid_name(line)) {
			printf("error: not one node's name: %s\n", line);
		} else if (slurm_load_node_single(&nodes, line, SHOW_MIXED) != SLURM_SUCCESS) {
			printf("error: %s\n", slurm_strerror(slurm_get_errno()));
		} else if ((!parts || time(NULL) - parts_read > PARTS_MAX_AGE_S) && (rc = refresh_parts())) {
			printf("error: %s\n", slurm_strerror(rc));
			slurm_free_node_info_msg(nodes);
		} else {
			slurm_populate_node_partitions(nodes, parts);
			if (nodes->record_count == 0)
				printf("Node %s not found\n", line);
			for (uint32_t i = 0; i < nodes->record_count; i++)
				slurm_print_node_table(stdout, &nodes->node_array[i], 0);
			slurm_free_node_info_msg(nodes);
		}
		printf("%s\n", argv[1]);
		fflush(stdout);
	}
	if (parts)
		slurm_free_partition_info_msg(parts);
	slurm_fini();
	return 0;
}
