/*
 * knit: the executable container runtimes start for every CNI call.
 *
 * It hands ADD, CHECK and DEL to the node daemon's fast path (cni/server.py) and prints the
 * answer; everything else, and every call the daemon cannot take, it hands to the Python
 * plugin by exec (cni/client.py runs it in-process). A CPython start alone costs about what
 * the Go reference plugin takes for a whole call, so the executable on this path is compiled;
 * the plugin itself is the Python package. This file parses no JSON and knows no CNI verb's
 * meaning: errors are printed by the Python plugin, in the call's cniVersion.
 *
 * Its settings are in knit.d/launch beside the executable (the directory of argv[0], as the
 * runtime names it), written by cni/install.py or the Makefile, one "key=value" per line:
 *   plugin=PATH   the Python plugin's executable, relative to this directory unless absolute
 *   socket=PATH   the daemon's unix socket; absent or empty: every call runs in-process
 *
 * Wire format, one call per connection (lengths are 4-byte big-endian):
 *   request:  version byte, sent alone with the descriptor of CNI_NETNS as SCM_RIGHTS
 *             ancillary data (none when CNI_NETNS is empty), len + environment ("KEY=VALUE"
 *             joined by NUL: the CNI_* variables), len + stdin
 *   response: version byte, exit code byte, len + stdout
 * Each side checks the other's version byte first. Exit code DECLINED says the daemon did not
 * run the call (over its limits): the plugin runs it in-process, with the same stdin.
 *
 * Nothing on this path waits forever: a daemon that is stopped (SIGSTOP, a frozen cgroup) or
 * stuck must not hold every pod's ADD and DEL on the node. Three deadlines, each safe:
 *   connect   CONNECT_DEADLINE_MS: nothing was sent, so the call runs in-process.
 *   pickup    PICKUP_DEADLINE_MS after sending, the daemon must have read the whole request.
 *             If it has not (SIOCOUTQ: bytes of ours still unread), the plugin first shuts
 *             its reading end, which the daemon sees as a hang-up (POLLHUP) and checks after
 *             reading a request and before running it; only then, if the request is still
 *             unread, does the call run in-process. So a daemon that wakes later finds the
 *             hang-up and runs nothing, and no call is ever run twice.
 *   answer    ANSWER_DEADLINE_MS after sending, for a call the daemon has read: it may be
 *             running, so redoing it could race it (an ADD, or a DEL against a late ADD);
 *             the call fails with error 199, which the runtime retries (a DEL too: it is
 *             idempotent). The daemon's own deadline for a call (cni/server.py) is shorter,
 *             so a live daemon answers with its own error first.
 *
 * The executable opens CNI_NETNS itself because the daemon lives in mount and PID namespaces
 * of its own, where the runtime's path may name nothing or something else. When it cannot,
 * the call runs in-process and reports that as it would without a daemon.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define PROTOCOL 2
#define DECLINED 255
#define LENGTH_BYTES 4
#define HEADER_BYTES (2 + LENGTH_BYTES)
#define LAUNCH_FILE "knit.d/launch"
/* A connect waits only when the daemon's backlog is full: it is not accepting. */
#ifndef CONNECT_DEADLINE_MS
#define CONNECT_DEADLINE_MS 1000
#endif
/* The daemon reads a request within milliseconds of its sending; its own limit from accept to
 * the whole request is 2 s (cni/server.py REQUEST_DEADLINE), after which it declines. */
#ifndef PICKUP_DEADLINE_MS
#define PICKUP_DEADLINE_MS 2000
#endif
/* Beyond the daemon's bound on a call (80 s, cni/server.py CALL_DEADLINE), within kubelet's
 * 2-minute runtime request timeout. */
#ifndef ANSWER_DEADLINE_MS
#define ANSWER_DEADLINE_MS 90000
#endif
/* cni/client.py prints this message as the call's error JSON (code 199) */
#define ERROR_VARIABLE "KNIT_FAST_PATH_ERROR"

extern char **environ;

struct buffer {
    char *data;
    size_t size;
    size_t capacity;
};

static void append(struct buffer *buffer, const void *data, size_t size)
{
    if (buffer->size + size > buffer->capacity) {
        size_t capacity = buffer->capacity ? buffer->capacity : 4096;
        while (capacity < buffer->size + size)
            capacity *= 2;
        char *grown = realloc(buffer->data, capacity);
        if (grown == NULL) {
            fputs("knit: out of memory\n", stderr);
            _exit(1);
        }
        buffer->data = grown;
        buffer->capacity = capacity;
    }
    memcpy(buffer->data + buffer->size, data, size);
    buffer->size += size;
}

static void append_length(struct buffer *buffer, size_t size)
{
    unsigned char length[LENGTH_BYTES] = {size >> 24, size >> 16, size >> 8, size};
    append(buffer, length, LENGTH_BYTES);
}

/* Everything fd gives until its end; false on a read error. */
static int read_all(int fd, struct buffer *into)
{
    char chunk[65536];
    for (;;) {
        ssize_t got = read(fd, chunk, sizeof chunk);
        if (got == 0)
            return 1;
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return 0;
        }
        append(into, chunk, (size_t)got);
    }
}

static void write_all(int fd, const char *data, size_t size)
{
    while (size > 0) {
        ssize_t done = write(fd, data, size);
        if (done < 0 && errno == EINTR)
            continue;
        if (done <= 0)
            return;
        data += done;
        size -= (size_t)done;
    }
}

struct launch {
    char plugin[4096];
    char socket[sizeof(((struct sockaddr_un *)0)->sun_path)];
};

/* The length of argv[0]'s directory part with its slash (0 when it has none): the runtime
 * starts the plugin by its path in the CNI bin directory. */
static size_t directory_length(const char *self)
{
    const char *slash = strrchr(self, '/');
    return slash ? (size_t)(slash - self + 1) : 0;
}

static int read_launch(const char *self, struct launch *launch)
{
    char path[4096], text[8192];
    size_t directory = directory_length(self);
    if (snprintf(path, sizeof path, "%.*s%s", (int)directory, self, LAUNCH_FILE) >= (int)sizeof path)
        return 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t size = read(fd, text, sizeof text - 1);
    close(fd);
    if (size <= 0)
        return 0;
    text[size] = '\0';
    launch->plugin[0] = launch->socket[0] = '\0';
    for (char *line = strtok(text, "\n"); line != NULL; line = strtok(NULL, "\n")) {
        if (strncmp(line, "plugin=", 7) == 0) {
            const char *value = line + 7;
            int written = value[0] == '/'
                ? snprintf(launch->plugin, sizeof launch->plugin, "%s", value)
                : snprintf(launch->plugin, sizeof launch->plugin, "%.*s%s", (int)directory, self, value);
            if (written >= (int)sizeof launch->plugin)
                return 0;
        } else if (strncmp(line, "socket=", 7) == 0) {
            if (snprintf(launch->socket, sizeof launch->socket, "%s", line + 7) >= (int)sizeof launch->socket)
                return 0;
        }
    }
    return launch->plugin[0] != '\0';
}

/* Run the call in the Python plugin. When stdin was read already, the plugin gets it back
 * from a memory file; a message becomes the call's error JSON there. */
static void run_in_process(const struct launch *launch, char **argv, const struct buffer *stdin_read,
                           const char *error)
{
    if (stdin_read != NULL) {
        int fd = memfd_create("knit-stdin", 0);
        if (fd < 0 || (write_all(fd, stdin_read->data, stdin_read->size), lseek(fd, 0, SEEK_SET)) != 0
            || dup2(fd, 0) < 0) {
            perror("knit: cannot hand the call's stdin over");
            _exit(1);
        }
        close(fd);
    }
    if (error != NULL)
        setenv(ERROR_VARIABLE, error, 1);
    argv[0] = (char *)launch->plugin;
    execv(launch->plugin, argv);
    fprintf(stderr, "knit: cannot run the plugin %s: %s\n", launch->plugin, strerror(errno));
    _exit(1);
}

static int forwarded(const char *command)
{
    return command != NULL
        && (strcmp(command, "ADD") == 0 || strcmp(command, "CHECK") == 0 || strcmp(command, "DEL") == 0);
}

static void encode_request(struct buffer *request, const struct buffer *stdin_read)
{
    struct buffer variables = {0};
    for (char **variable = environ; *variable != NULL; variable++) {
        if (strncmp(*variable, "CNI_", 4) != 0)
            continue;
        if (variables.size > 0)
            append(&variables, "", 1);
        append(&variables, *variable, strlen(*variable));
    }
    append(request, (unsigned char[]){PROTOCOL}, 1);
    append_length(request, variables.size);
    append(request, variables.data, variables.size);
    append_length(request, stdin_read->size);
    append(request, stdin_read->data, stdin_read->size);
    free(variables.data);
}

static long long now_ms(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec * 1000LL + now.tv_nsec / 1000000;
}

static void set_send_timeout(int connection, long long ms)
{
    struct timeval timeout = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
    setsockopt(connection, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
}

/* The version byte alone carries the descriptor, so the daemon finds it on its first read.
 * A send error is not final: the daemon may have answered before it left. */
static void send_request(int connection, const struct buffer *request, int netns_fd)
{
    struct iovec first = {.iov_base = request->data, .iov_len = 1};
    union {
        char space[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr message = {.msg_iov = &first, .msg_iovlen = 1};
    if (netns_fd >= 0) {
        memset(&control, 0, sizeof control);
        message.msg_control = control.space;
        message.msg_controllen = sizeof control.space;
        struct cmsghdr *rights = CMSG_FIRSTHDR(&message);
        rights->cmsg_level = SOL_SOCKET;
        rights->cmsg_type = SCM_RIGHTS;
        rights->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(rights), &netns_fd, sizeof(int));
    }
    if (sendmsg(connection, &message, MSG_NOSIGNAL) != 1)
        return;
    size_t sent = 1;
    while (sent < request->size) {
        ssize_t done = send(connection, request->data + sent, request->size - sent, MSG_NOSIGNAL);
        if (done < 0 && errno == EINTR)
            continue;
        if (done <= 0)
            return;
        sent += (size_t)done;
    }
    shutdown(connection, SHUT_WR);
}

/* Bytes of the request the daemon has not read yet. When that cannot be known, 0: the daemon
 * may have the call, so it is not redone. */
static int unread(int connection)
{
    int queued = 0;
    return ioctl(connection, SIOCOUTQ, &queued) == 0 ? queued : 0;
}

enum outcome { ANSWERED, NOT_TAKEN, TAKEN_LATE, NO_ANSWER };

/* The daemon's answer, read until its end (or a reset, which the caller's checks catch), under
 * the pickup and answer deadlines counted from sent (see the top of this file). */
static enum outcome await_answer(int connection, struct buffer *answer, long long sent)
{
    long long pickup = sent + PICKUP_DEADLINE_MS, give_up = sent + ANSWER_DEADLINE_MS;
    int taken = 0;
    char chunk[65536];
    for (;;) {
        long long now = now_ms();
        taken = taken || answer->size > 0;
        if (!taken && now >= pickup) {
            if (unread(connection) == 0) {
                taken = 1;
            } else {
                /* first the hang-up, then the look: the daemon runs no request it finishes
                 * reading after this shutdown */
                shutdown(connection, SHUT_RD);
                return unread(connection) > 0 ? NOT_TAKEN : TAKEN_LATE;
            }
        }
        if (taken && now >= give_up)
            return NO_ANSWER;
        struct pollfd wait = {.fd = connection, .events = POLLIN};
        int ready = poll(&wait, 1, (int)((taken ? give_up : pickup) - now));
        if (ready < 0 && errno != EINTR)
            return ANSWERED;
        if (ready <= 0)
            continue;
        ssize_t got = read(connection, chunk, sizeof chunk);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            return ANSWERED;
        append(answer, chunk, (size_t)got);
    }
}

int main(int argc, char **argv)
{
    (void)argc;
    struct launch launch;
    if (!read_launch(argv[0], &launch)) {
        fprintf(stderr, "knit: cannot read %s beside %s\n", LAUNCH_FILE, argv[0]);
        return 1;
    }
    if (launch.socket[0] == '\0' || !forwarded(getenv("CNI_COMMAND")))
        run_in_process(&launch, argv, NULL, NULL);

    /* O_NONBLOCK: a FIFO placed at CNI_NETNS must not hold the call */
    const char *netns = getenv("CNI_NETNS");
    int netns_fd = -1;
    if (netns != NULL && netns[0] != '\0') {
        netns_fd = open(netns, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
        if (netns_fd < 0)
            run_in_process(&launch, argv, NULL, NULL); /* and names the namespace it cannot open */
    }

    int connection = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    memcpy(address.sun_path, launch.socket, sizeof launch.socket);
    if (connection >= 0)
        set_send_timeout(connection, CONNECT_DEADLINE_MS); /* a unix connect's wait */
    if (connection < 0 || connect(connection, (struct sockaddr *)&address, sizeof address) != 0) {
        int reason = errno;
        /* no daemon, or one not accepting by the deadline: nothing was sent */
        if (reason == ENOENT || reason == ECONNREFUSED || reason == EAGAIN)
            run_in_process(&launch, argv, NULL, NULL);
        char error[512];
        snprintf(error, sizeof error, "cannot reach the knit daemon at %s: %s", launch.socket, strerror(reason));
        struct buffer stdin_read = {0};
        read_all(0, &stdin_read);
        run_in_process(&launch, argv, &stdin_read, error);
    }

    struct buffer stdin_read = {0}, request = {0}, answer = {0};
    if (!read_all(0, &stdin_read))
        run_in_process(&launch, argv, NULL, NULL);
    encode_request(&request, &stdin_read);
    long long sent = now_ms();
    set_send_timeout(connection, PICKUP_DEADLINE_MS); /* a request bigger than the buffer */
    send_request(connection, &request, netns_fd);
    enum outcome outcome = await_answer(connection, &answer, sent);
    close(connection);
    if (outcome == NOT_TAKEN)
        run_in_process(&launch, argv, &stdin_read, NULL);
    if (outcome != ANSWERED) {
        char error[256];
        if (outcome == TAKEN_LATE)
            snprintf(error, sizeof error, "the knit daemon read the call only as its %d ms deadline passed: not redone",
                     PICKUP_DEADLINE_MS);
        else
            snprintf(error, sizeof error, "the knit daemon did not answer in %d s: the call may have run, not redone",
                     ANSWER_DEADLINE_MS / 1000);
        run_in_process(&launch, argv, &stdin_read, error);
    }

    /* Never redo a call the daemon has: a DECLINED answer says it has not. */
    const unsigned char *header = (const unsigned char *)answer.data;
    if (answer.size > 0 && header[0] != PROTOCOL) {
        char error[128];
        snprintf(error, sizeof error, "the knit daemon speaks protocol %d, this plugin speaks %d", header[0], PROTOCOL);
        run_in_process(&launch, argv, &stdin_read, error);
    }
    uint32_t size = answer.size >= HEADER_BYTES
        ? (uint32_t)header[2] << 24 | (uint32_t)header[3] << 16 | (uint32_t)header[4] << 8 | header[5]
        : 0;
    if (answer.size < HEADER_BYTES || answer.size != HEADER_BYTES + (size_t)size)
        run_in_process(&launch, argv, &stdin_read, "the knit daemon closed the connection before answering");
    if (header[1] == DECLINED) {
        run_in_process(&launch, argv, &stdin_read, NULL);
    }
    write_all(1, answer.data + HEADER_BYTES, size);
    return header[1];
}
