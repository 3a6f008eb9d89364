/* omni-node-read: a kept process that reads Slurm's record of one node per request, with one RPC of
 * that node's record (slurm_load_node_single) where `scontrol show node NAME` loads every node of the
 * cluster (slurm_load_node: at 512 nodes, a 512-record answer packed, sent, unpacked and searched
 * while the node loss it confirms tears the step down) and then the partitions. The partitions (for
 * the record's Partitions=, as scontrol's) come from a copy this process keeps: read at its start,
 * asked again (slurm_load_partitions with the copy's time: slurmctld answers "no change" unless an
 * admin changed them) whenever it sat idle PARTS_IDLE_MS, and before an answer when the copy is older
 * than PARTS_MAX_AGE_S, never on the way of a read that came soon after one: at 512 emulated nodes that
 * second RPC reached slurmctld 19-46 ms after the first, inside a node loss's teardown (2026-12-03 23:24).
 * Prints what scontrol prints (slurm_print_node_table), but for the state (print_node).
 *
 * stdin: one request a line, "NAME" (one node, no list). stdout: the node's record, or one line
 * "error: <Slurm's message>", then the end word given as the only argument, on a line of its own. The
 * supervisor (slurm/node_read.py) writes a name and reads to the end word. Ends at EOF of stdin. */
#include <slurm/slurm.h>
#include <slurm/slurm_errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
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

/* The base state's word as slurm_print_node_table writes it; NULL for the busy ones (kept as printed). */
static const char *idle_base_word(uint32_t state)
{
	switch (state & NODE_STATE_BASE) {
	case NODE_STATE_UNKNOWN: return "UNKNOWN";
	case NODE_STATE_DOWN: return "DOWN";
	case NODE_STATE_IDLE: return "IDLE";
	case NODE_STATE_ERROR: return "ERROR";
	case NODE_STATE_FUTURE: return "FUTURE";
	default: return NULL;
	}
}

/* The record as slurm_print_node_table prints it, with State='s base word from the record's own state.
 * slurmctld answers the one-node read without recounting the nodes' allocated CPUs (proc_req.c,
 * _slurm_rpc_dump_node_single: the recount is left out as too slow), so the count is that of the last
 * whole read, and the print turns a node with some of them allocated into MIXED whatever its base
 * state: a node set DOWN under a job read MIXED (CPUAlloc=2) until the next whole read, 0.8-1.4 s
 * later in the 8-node demo (2026-12-04 04:31), where scontrol printed State=DOWN CPUAlloc=0 (its
 * read recounts). The flags after the base word stay; CPUAlloc= stays the stale count. */
static void print_node(node_info_t *node)
{
	char *text = NULL, *state;
	size_t len = 0;
	const char *base = idle_base_word(node->node_state);
	FILE *f = open_memstream(&text, &len);

	if (!f) {
		slurm_print_node_table(stdout, node, 0);
		return;
	}
	slurm_print_node_table(f, node, 0);
	fclose(f);
	state = strstr(text, " State=MIXED");
	if (base && state) {
		state += strlen(" State=");
		fwrite(text, 1, state - text, stdout);
		fputs(base, stdout);
		fputs(state + strlen("MIXED"), stdout);
	} else {
		fputs(text, stdout);
	}
	free(text);
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
		} else if (slurm_load_node_single(&nodes, line, 0) != SLURM_SUCCESS) {
			printf("error: %s\n", slurm_strerror(slurm_get_errno()));
		} else if ((!parts || time(NULL) - parts_read > PARTS_MAX_AGE_S) && (rc = refresh_parts())) {
			printf("error: %s\n", slurm_strerror(rc));
			slurm_free_node_info_msg(nodes);
		} else {
			slurm_populate_node_partitions(nodes, parts);
			if (nodes->record_count == 0)
				printf("Node %s not found\n", line);
			for (uint32_t i = 0; i < nodes->record_count; i++)
				print_node(&nodes->node_array[i]);
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
