#include "fault.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define RECORD_MAX 2048

/* JSON string body of src (at most srclen bytes), bounded by dst's size. */
static int json_escape(const char *src, size_t srclen, char *dst, size_t dstlen)
{
	size_t o = 0;

	for (size_t i = 0; i < srclen && src[i] != '\0'; i++) {
		unsigned char c = (unsigned char)src[i];
		char tmp[8];
		size_t n;

		if (c == '"' || c == '\\') {
			tmp[0] = '\\';
			tmp[1] = (char)c;
			n = 2;
		} else if (c < 0x20 || c == 0x7f) {
			n = (size_t)snprintf(tmp, sizeof(tmp), "\\u%04x", c);
		} else {
			tmp[0] = (char)c;
			n = 1;
		}
		if (o + n >= dstlen)
			return -1;
		memcpy(dst + o, tmp, n);
		o += n;
	}
	if (o >= dstlen)
		return -1;
	dst[o] = '\0';
	return 0;
}

/* File names carry the node name: keep them to a safe alphabet. */
static void name_part(const char *src, char *dst, size_t dstlen)
{
	size_t o = 0;

	for (size_t i = 0; src[i] != '\0' && o + 1 < dstlen; i++) {
		char c = src[i];

		dst[o++] = ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
			    c == '-' || c == '_') ? c : '_';
	}
	dst[o] = '\0';
}

int omni_fault_format(const struct omni_fault *f, char *buf, size_t len)
{
	char node[OMNI_NODE_MAX * 6];
	char stage[OMNI_NAME_MAX * 6];
	char when[32];
	char exit_code[16] = "null";
	char signal[16] = "null";
	struct tm tm;
	int n;

	if (json_escape(f->node, sizeof(f->node), node, sizeof(node)) < 0 ||
	    json_escape(f->stage, sizeof(f->stage), stage, sizeof(stage)) < 0)
		return -1;
	if (gmtime_r(&f->time.tv_sec, &tm) == NULL || strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", &tm) == 0)
		return -1;
	if (WIFEXITED(f->status))
		snprintf(exit_code, sizeof(exit_code), "%d", WEXITSTATUS(f->status));
	if (WIFSIGNALED(f->status))
		snprintf(signal, sizeof(signal), "%d", WTERMSIG(f->status));
	n = snprintf(buf, len,
		     "{\"version\": %d, \"kind\": \"task_exit\", \"job_id\": %u, \"het_job_id\": %ld, "
		     "\"het_offset\": %ld, \"step_id\": %u, \"node\": \"%s\", \"stage\": \"%s\", "
		     "\"stage_index\": %ld, \"stage_rank\": %ld, \"task_id\": %ld, \"local_task_id\": %ld, \"pid\": %ld, \"exit_code\": %s, \"signal\": %s, "
		     "\"core_dumped\": %s, \"time\": \"%s.%03ldZ\", \"time_unix\": %lld.%09ld}\n",
		     OMNI_FAULT_VERSION, f->job_id, f->het_job_id, f->het_offset, f->step_id, node, stage,
		     f->stage_index, f->stage_rank, f->task_id, f->local_task_id, f->pid, exit_code, signal,
		     (WIFSIGNALED(f->status) && WCOREDUMP(f->status)) ? "true" : "false", when,
		     f->time.tv_nsec / 1000000L, (long long)f->time.tv_sec, f->time.tv_nsec);
	if (n < 0 || (size_t)n >= len)
		return -1;
	return n;
}

static int write_all(int fd, const char *buf, size_t len)
{
	while (len > 0) {
		ssize_t w = write(fd, buf, len);

		if (w < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		buf += w;
		len -= (size_t)w;
	}
	return 0;
}

/* A user name as a directory name: what useradd allows, never "." or "..". */
static int name_ok(const char *name)
{
	size_t n = strlen(name);

	if (n == 0 || n > OMNI_USER_MAX || name[0] == '.' || name[0] == '-')
		return 0;
	for (size_t i = 0; i < n; i++) {
		char c = name[i];

		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
		      c == '_' || c == '.' || c == '$'))
			return 0;
	}
	return 1;
}

/* The spool root must be ours (or root's) and writable by nobody else: whoever can rename entries
 * in it could swap a user's directory for a link between our check and our write. */
static int open_root(const char *dir, char *err, size_t errlen)
{
	struct stat st;
	int fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);

	if (fd < 0) {
		omni_set_err(err, errlen, "couldn't open spool %.200s: %s", dir, strerror(errno));
		return -1;
	}
	if (fstat(fd, &st) < 0 || (st.st_uid != 0 && st.st_uid != geteuid()) || (st.st_mode & 022)) {
		omni_set_err(err, errlen, "couldn't use spool %.200s: owned by uid %ld with mode %04o "
			     "(expected root's, not group/other writable)", dir, (long)st.st_uid,
			     (unsigned)(st.st_mode & 07777));
		close(fd);
		return -1;
	}
	return fd;
}

/* <spool>/<user>, made 0700 and handed to the user on first use; refused unless the user owns it
 * and nobody else can write to it (the manager reading it runs as that user). */
static int open_user_dir(int root, const char *dir, const struct omni_owner *owner, char *err, size_t errlen)
{
	struct stat st;
	int fd = openat(root, owner->name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);

	if (fd < 0 && errno == ENOENT) {
		if (mkdirat(root, owner->name, 0700) < 0 && errno != EEXIST) {
			omni_set_err(err, errlen, "couldn't create %.200s/%s: %s", dir, owner->name, strerror(errno));
			return -1;
		}
		fd = openat(root, owner->name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		/* nobody else can write to the root: what we just made is still ours to hand over */
		if (fd >= 0 && fstat(fd, &st) == 0 && st.st_uid == geteuid() && st.st_uid != owner->uid &&
		    fchown(fd, owner->uid, owner->gid) < 0) {
			omni_set_err(err, errlen, "couldn't hand %.200s/%s to uid %ld: %s", dir, owner->name,
				     (long)owner->uid, strerror(errno));
			close(fd);
			return -1;
		}
	}
	if (fd < 0) {
		omni_set_err(err, errlen, "couldn't open %.200s/%s: %s", dir, owner->name, strerror(errno));
		return -1;
	}
	if (fstat(fd, &st) < 0 || st.st_uid != owner->uid || (st.st_mode & 022)) {
		omni_set_err(err, errlen, "couldn't use %.200s/%s: owned by uid %ld with mode %04o (expected uid %ld, "
			     "not group/other writable)", dir, owner->name, (long)st.st_uid,
			     (unsigned)(st.st_mode & 07777), (long)owner->uid);
		close(fd);
		return -1;
	}
	return fd;
}

int omni_fault_write(const char *dir, const struct omni_owner *owner, const struct omni_fault *f, char *path,
		     size_t pathlen, char *err, size_t errlen)
{
	int rv = -1;
	int root = -1;
	int udir = -1;
	int fd = -1;
	int created = 0;
	int n;
	char record[RECORD_MAX];
	char node[64];
	char base[160];
	char tmp[200];

	n = omni_fault_format(f, record, sizeof(record));
	if (n < 0) {
		omni_set_err(err, errlen, "couldn't format fault record: longer than %d bytes", RECORD_MAX);
		goto fail;
	}
	if (!name_ok(owner->name)) {
		omni_set_err(err, errlen, "couldn't name the spool of user '%.64s': not a plain user name", owner->name);
		goto fail;
	}
	name_part(f->node, node, sizeof(node));
	/* job, step, node, task and time make the name unique; the manager globs fault-*.json */
	snprintf(base, sizeof(base), "fault-%u.%u-%s-%ld-%lld%09ld.json", f->job_id, f->step_id, node,
		 f->task_id, (long long)f->time.tv_sec, f->time.tv_nsec);
	snprintf(tmp, sizeof(tmp), ".%s.tmp", base);
	if ((size_t)snprintf(path, pathlen, "%s/%s/%s", dir, owner->name, base) >= pathlen) {
		omni_set_err(err, errlen, "couldn't name fault record in %.128s: path too long", dir);
		goto fail;
	}
	root = open_root(dir, err, errlen);
	if (root < 0)
		goto fail;
	udir = open_user_dir(root, dir, owner, err, errlen);
	if (udir < 0)
		goto fail;
	fd = openat(udir, tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
	if (fd < 0) {
		omni_set_err(err, errlen, "couldn't create %.200s/%s/%s: %s", dir, owner->name, tmp, strerror(errno));
		goto fail;
	}
	created = 1;
	/* the record is the user's (the directory's owner): their manager reads it and removes it */
	if (fchown(fd, owner->uid, owner->gid) < 0 || write_all(fd, record, (size_t)n) < 0 || fsync(fd) < 0) {
		omni_set_err(err, errlen, "couldn't write %.200s/%s/%s: %s", dir, owner->name, tmp, strerror(errno));
		goto fail;
	}
	if (close(fd) < 0) {
		fd = -1;
		omni_set_err(err, errlen, "couldn't close %.200s/%s/%s: %s", dir, owner->name, tmp, strerror(errno));
		goto fail;
	}
	fd = -1;
	if (renameat(udir, tmp, udir, base) < 0) {
		omni_set_err(err, errlen, "couldn't rename %.200s/%s/%s: %s", dir, owner->name, tmp, strerror(errno));
		goto fail;
	}
	created = 0;
	if (fsync(udir) < 0) {
		omni_set_err(err, errlen, "couldn't sync %.200s/%s: %s", dir, owner->name, strerror(errno));
		goto fail;
	}
	rv = 0;
fail:
	if (fd >= 0)
		close(fd);
	if (created)
		unlinkat(udir, tmp, 0);
	if (udir >= 0)
		close(udir);
	if (root >= 0)
		close(root);
	return rv;
}
