#include "shm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/stat.h>
#include <unistd.h>

#include "args.h"

#define BEATS_PREFIX "omni-beats-"
#define MEMTIER_PREFIX "omni-"
#define PEER_DEPTH 1 /* <job>/peer/ is the only folder the tier makes inside the job's */

void omni_shm_safe(const char *text, char *out, size_t outlen)
{
	size_t o = 0;

	if (outlen == 0)
		return;
	for (size_t i = 0; text[i] != '\0' && o + 1 < outlen && o < OMNI_SHM_PART_MAX - 1; i++) {
		char c = text[i];

		out[o++] = ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
			    c == '.' || c == '-') ? c : '_';
	}
	out[o] = '\0';
}

int omni_shm_expand_node(const char *pattern, const char *node, char *out, size_t outlen)
{
	char safe[OMNI_SHM_PART_MAX];
	size_t o = 0;

	omni_shm_safe(node, safe, sizeof(safe));
	for (const char *p = pattern; *p != '\0'; p++) {
		const char *piece = p;
		size_t n = 1;

		if (p[0] == '%' && p[1] == 'n') {
			piece = safe;
			n = strlen(safe);
			p++;
		}
		if (o + n >= outlen)
			return -1;
		memcpy(out + o, piece, n);
		o += n;
	}
	out[o] = '\0';
	return 0;
}

int omni_hostlist_many(const char *hostlist)
{
	int depth = 0;

	for (const char *p = hostlist; *p != '\0'; p++) {
		if (*p == '[')
			depth++;
		else if (*p == ']' && depth > 0)
			depth--;
		else if (*p == ',' || (*p == '-' && depth > 0))
			return 1;
	}
	return 0;
}

static void kept(struct omni_shm_result *res, const char *dir, const char *name, const char *why)
{
	res->kept++;
	/* a longer path is cut: the line names the first object left, for a person to look at */
	if (res->first_kept[0] == '\0' &&
	    snprintf(res->first_kept, sizeof(res->first_kept), "%s/%s (%s)", dir, name, why) >= (int)sizeof(res->first_kept))
		res->first_kept[sizeof(res->first_kept) - 1] = '\0';
}

int omni_shm_beats_name(const struct omni_shm_job *job, const char *name, const char *node)
{
	char prefix[sizeof(BEATS_PREFIX) + 24 + OMNI_SHM_PART_MAX + 1];
	char want[OMNI_SHM_PART_MAX];

	if (node != NULL)
		omni_shm_safe(node, want, sizeof(want));
	for (int i = 0; i < 2; i++) {
		char id[OMNI_SHM_PART_MAX];
		size_t len;

		if (job->ids[i] == NULL || job->ids[i][0] == '\0')
			continue;
		omni_shm_safe(job->ids[i], id, sizeof(id));
		len = (size_t)snprintf(prefix, sizeof(prefix), BEATS_PREFIX "%lu-%s-", (unsigned long)job->uid, id);
		if (len >= sizeof(prefix) || strncmp(name, prefix, len) != 0 || name[len] == '\0')
			continue;
		if (node == NULL || strcmp(name + len, want) == 0)
			return 1;
	}
	return 0;
}

/* The owner's file-system ids for what follows; the previous ones in *old. */
static int become(uid_t uid, gid_t gid, uid_t *old_uid, gid_t *old_gid)
{
	*old_gid = (gid_t)setfsgid(gid);
	*old_uid = (uid_t)setfsuid(uid);
	/* setfsuid returns the previous value whether or not it changed anything: ask again */
	if ((uid_t)setfsuid(uid) == uid && (gid_t)setfsgid(gid) == gid)
		return 0;
	setfsuid(*old_uid);
	setfsgid(*old_gid);
	return -1;
}

static void restore(uid_t old_uid, gid_t old_gid)
{
	setfsuid(old_uid);
	setfsgid(old_gid);
}

/* Removes parent/name, a folder of uid, with its files and (depth > 0) its folders; what it leaves
 * is counted in res. */
static void remove_folder(int parent, const char *dir, const char *name, uid_t uid, int depth,
			  struct omni_shm_result *res)
{
	struct stat st;
	struct dirent *d;
	DIR *listing;
	char path[512];
	int fd;

	fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (fd < 0) {
		if (errno != ENOENT)   /* ENOENT: another node's epilog (one /dev/shm) took it first */
			kept(res, dir, name, errno == ENOTDIR || errno == ELOOP ? "not a folder" : strerror(errno));
		return;
	}
	if (fstat(fd, &st) < 0 || st.st_uid != uid) {
		char why[64];

		snprintf(why, sizeof(why), "owned by uid %lu, not the job's", (unsigned long)st.st_uid);
		kept(res, dir, name, why);
		close(fd);
		return;
	}
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	listing = fdopendir(fd);
	if (listing == NULL) {
		kept(res, dir, name, strerror(errno));
		close(fd);
		return;
	}
	while ((d = readdir(listing)) != NULL) {
		struct stat entry;

		if (strcmp(d->d_name, ".") == 0 || strcmp(d->d_name, "..") == 0)
			continue;
		if (fstatat(fd, d->d_name, &entry, AT_SYMLINK_NOFOLLOW) < 0)
			continue;
		if (S_ISDIR(entry.st_mode)) {
			if (depth > 0)
				remove_folder(fd, path, d->d_name, uid, depth - 1, res);
			else
				kept(res, path, d->d_name, "a folder the job does not make");
		} else if (entry.st_uid != uid) {
			kept(res, path, d->d_name, "another uid's");
		} else if (unlinkat(fd, d->d_name, 0) == 0) {   /* a link goes, not what it points to */
			res->bytes += (long long)entry.st_size;
		}
	}
	closedir(listing);
	if (unlinkat(parent, name, AT_REMOVEDIR) == 0)
		res->removed++;
	else if (errno != ENOENT)
		kept(res, dir, name, strerror(errno));
}

struct fs_ids {
	uid_t uid;
	gid_t gid;
};

/* dir opened with the job owner's file-system ids (kept until leave()); -1: dir is missing (nothing
 * to do), -2: one line in err; both with the ids restored. */
static int enter(const char *dir, const struct omni_shm_job *job, struct fs_ids *saved, char *err, size_t errlen)
{
	int fd;

	if (become(job->uid, job->gid, &saved->uid, &saved->gid) < 0) {
		omni_set_err(err, errlen, "couldn't act as uid %lu (setfsuid)", (unsigned long)job->uid);
		return -2;
	}
	fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (fd >= 0)
		return fd;
	if (errno == ENOENT) {
		restore(saved->uid, saved->gid);
		return -1;
	}
	omni_set_err(err, errlen, "couldn't open %s: %s", dir, strerror(errno));
	restore(saved->uid, saved->gid);
	return -2;
}

int omni_shm_clean_beats(const char *dir, const struct omni_shm_job *job, int *others, struct omni_shm_result *res,
			 char *err, size_t errlen)
{
	struct fs_ids saved;
	struct dirent *d;
	DIR *listing;
	int fd;

	*others = 0;
	fd = enter(dir, job, &saved, err, errlen);
	if (fd < 0)
		return fd == -1 ? 0 : -1;
	listing = fdopendir(fd);
	if (listing == NULL) {
		omni_set_err(err, errlen, "couldn't list %s: %s", dir, strerror(errno));
		close(fd);
		restore(saved.uid, saved.gid);
		return -1;
	}
	while ((d = readdir(listing)) != NULL) {
		if (!omni_shm_beats_name(job, d->d_name, NULL))
			continue;
		if (job->whole_job || omni_shm_beats_name(job, d->d_name, job->node))
			remove_folder(fd, dir, d->d_name, job->uid, 0, res);
		else
			(*others)++;
	}
	closedir(listing);
	restore(saved.uid, saved.gid);
	return 0;
}

int omni_shm_memtier_due(int whole_job, int per_node_dir, int other_beats_left)
{
	return whole_job || per_node_dir || other_beats_left == 0;
}

int omni_shm_clean_memtier(const char *dir, const struct omni_shm_job *job, struct omni_shm_result *res, char *err,
			   size_t errlen)
{
	char own[sizeof(MEMTIER_PREFIX) + 24];
	char path[512];
	struct fs_ids saved;
	struct stat st;
	int fd;
	int user;

	fd = enter(dir, job, &saved, err, errlen);
	if (fd < 0)
		return fd == -1 ? 0 : -1;
	snprintf(own, sizeof(own), MEMTIER_PREFIX "%lu", (unsigned long)job->uid);
	snprintf(path, sizeof(path), "%s/%s", dir, own);
	user = openat(fd, own, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (user < 0) {
		if (errno != ENOENT)
			kept(res, dir, own, errno == ENOTDIR || errno == ELOOP ? "not a folder" : strerror(errno));
	} else if (fstat(user, &st) < 0 || st.st_uid != job->uid) {
		kept(res, dir, own, "not the job's uid");
	} else {
		for (int i = 0; i < 2; i++) {
			char id[OMNI_SHM_PART_MAX];

			if (job->ids[i] == NULL || job->ids[i][0] == '\0')
				continue;
			omni_shm_safe(job->ids[i], id, sizeof(id));
			remove_folder(user, path, id, job->uid, PEER_DEPTH, res);
		}
		/* omni-<uid>/ stays: the user's next job on the node may be making its folder in it now */
	}
	if (user >= 0)
		close(user);
	close(fd);
	restore(saved.uid, saved.gid);
	return 0;
}
