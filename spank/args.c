#include "args.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char spool_key[] = "spool=";
static const char memory_dir_key[] = "memory_dir=";

void omni_set_err(char *err, size_t errlen, const char *fmt, ...)
{
	va_list ap;

	if (err == NULL || errlen == 0)
		return;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}

static int has_prefix(const char *s, const char *prefix)
{
	return strncmp(s, prefix, strlen(prefix)) == 0;
}

int omni_parse_long(const char *text, long min, long max, long *out)
{
	char *end = NULL;
	long v;

	if (text == NULL || *text == '\0' || !isdigit((unsigned char)*text))
		return -1;
	errno = 0;
	v = strtol(text, &end, 10);
	if (errno != 0 || end == text || *end != '\0' || v < min || v > max)
		return -1;
	*out = v;
	return 0;
}

int omni_check_path(const char *what, const char *arg, char *err, size_t errlen)
{
	size_t len;

	if (arg == NULL || arg[0] != '/') {
		omni_set_err(err, errlen, "%s=%.64s: not allowed (expected an absolute path)", what, arg ? arg : "");
		return -1;
	}
	len = strnlen(arg, PATH_MAX);
	if (len >= PATH_MAX) {
		omni_set_err(err, errlen, "%s: path longer than %d bytes", what, PATH_MAX - 1);
		return -1;
	}
	for (size_t i = 0; i < len; i++) {
		if (iscntrl((unsigned char)arg[i])) {
			omni_set_err(err, errlen, "%s=%.64s: not allowed (control character at byte %zu)", what, arg, i);
			return -1;
		}
	}
	return 0;
}

int omni_parse_config(int ac, char **av, struct omni_config *cfg, char *err, size_t errlen)
{
	memset(cfg, 0, sizeof(*cfg));
	for (int i = 0; i < ac; i++) {
		if (has_prefix(av[i], spool_key)) {
			const char *dir = av[i] + strlen(spool_key);

			if (omni_check_path("spool", dir, err, errlen) < 0)
				return -1;
			/* omni_check_path bounded the length below PATH_MAX */
			memcpy(cfg->spool, dir, strlen(dir) + 1);
		} else if (has_prefix(av[i], memory_dir_key)) {
			const char *dir = av[i] + strlen(memory_dir_key);

			if (omni_check_path("memory_dir", dir, err, errlen) < 0)
				return -1;
			memcpy(cfg->memory_dir, dir, strlen(dir) + 1);
		} else {
			omni_set_err(err, errlen, "unknown plugin argument '%.64s' (allowed: spool=DIR, memory_dir=DIR)",
				     av[i]);
			return -1;
		}
	}
	return 0;
}

static int valid_name_char(char c)
{
	return isalnum((unsigned char)c) || c == '_' || c == '-' || c == '.';
}

static int parse_one_stage(const char *item, size_t len, struct omni_stage *st, char *err, size_t errlen)
{
	size_t name_len = 0;
	char count[24];

	while (name_len < len && item[name_len] != ':')
		name_len++;
	if (name_len == 0 || name_len >= OMNI_NAME_MAX) {
		omni_set_err(err, errlen, "stage name '%.*s' is not allowed (expected 1 to %d characters)",
			(int)(name_len < 64 ? name_len : 64), item, OMNI_NAME_MAX - 1);
		return -1;
	}
	for (size_t i = 0; i < name_len; i++) {
		if (!valid_name_char(item[i])) {
			omni_set_err(err, errlen, "stage name '%.*s' is not allowed (letters, digits, '_', '-', '.')",
				(int)name_len, item);
			return -1;
		}
	}
	memcpy(st->name, item, name_len);
	st->name[name_len] = '\0';
	st->ntasks = -1;
	if (name_len == len)
		return 0;
	if (len - name_len - 1 == 0 || len - name_len - 1 >= sizeof(count)) {
		omni_set_err(err, errlen, "stage '%s': task count '%.*s' is not allowed (expected 1..1000000)",
			st->name, (int)(len - name_len - 1 < 24 ? len - name_len - 1 : 24), item + name_len + 1);
		return -1;
	}
	memcpy(count, item + name_len + 1, len - name_len - 1);
	count[len - name_len - 1] = '\0';
	if (omni_parse_long(count, 1, 1000000, &st->ntasks) < 0) {
		omni_set_err(err, errlen, "stage '%s': task count '%s' is not allowed (expected 1..1000000)",
			st->name, count);
		return -1;
	}
	return 0;
}

int omni_parse_stages(const char *arg, struct omni_stage_list *out, char *err, size_t errlen)
{
	const char *p = arg;

	memset(out, 0, sizeof(*out));
	if (arg == NULL || *arg == '\0') {
		omni_set_err(err, errlen, "empty value (expected NAME[:NTASKS][,NAME[:NTASKS]...])");
		return -1;
	}
	for (;;) {
		const char *comma = strchr(p, ',');
		size_t len = comma ? (size_t)(comma - p) : strlen(p);

		if (out->count == OMNI_MAX_STAGES) {
			omni_set_err(err, errlen, "more than %d stages", OMNI_MAX_STAGES);
			return -1;
		}
		if (parse_one_stage(p, len, &out->stages[out->count], err, errlen) < 0)
			return -1;
		for (int i = 0; i < out->count; i++) {
			if (strcmp(out->stages[i].name, out->stages[out->count].name) == 0) {
				omni_set_err(err, errlen, "stage '%s' given twice", out->stages[i].name);
				return -1;
			}
		}
		out->count++;
		if (comma == NULL)
			break;
		p = comma + 1;
	}
	return 0;
}

int omni_place(const struct omni_stage_list *stages, long het_offset, long comp_rank, long comp_size,
	       long global_rank, long global_size, struct omni_placement *out, char *err, size_t errlen)
{
	long first = 0;
	long total = 0;

	if (stages->count == 1) {
		out->stage = 0;
		out->stage_rank = het_offset >= 0 ? comp_rank : global_rank;
		out->stage_size = het_offset >= 0 ? comp_size : global_size;
		return 0;
	}
	if (het_offset >= 0) {
		if (het_offset >= stages->count) {
			omni_set_err(err, errlen, "het component %ld has no stage (%d given)", het_offset, stages->count);
			return -1;
		}
		out->stage = (int)het_offset;
		out->stage_rank = comp_rank;
		out->stage_size = comp_size;
		return 0;
	}
	for (int i = 0; i < stages->count; i++) {
		if (stages->stages[i].ntasks < 0) {
			omni_set_err(err, errlen, "stage '%s' needs a task count in an ordinary step (NAME:NTASKS)",
				stages->stages[i].name);
			return -1;
		}
		total += stages->stages[i].ntasks;
	}
	if (total != global_size) {
		omni_set_err(err, errlen, "stages name %ld tasks but the step has %ld", total, global_size);
		return -1;
	}
	for (int i = 0; i < stages->count; i++) {
		if (global_rank < first + stages->stages[i].ntasks) {
			out->stage = i;
			out->stage_rank = global_rank - first;
			out->stage_size = stages->stages[i].ntasks;
			return 0;
		}
		first += stages->stages[i].ntasks;
	}
	omni_set_err(err, errlen, "rank %ld is beyond the %ld tasks of the step", global_rank, total);
	return -1;
}
