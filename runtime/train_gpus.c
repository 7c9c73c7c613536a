/* train_gpus.c — several GPUs on one host: the launcher of a data-parallel run.
 *
 * A data-parallel run is one process per GPU. --gpus N forks them here, before anything of
 * CUDA or NCCL is touched in this process (neither survives a fork), each a rank that runs the
 * training (train.c) with --rank r --world-size N and a comm file in a fresh temp directory; the
 * launcher then only waits. One process per GPU rather than one thread per GPU keeps every
 * rank exactly the program a user-launched rank runs (one code path to test), and keeps the
 * executor, the device table and the error line per process as they are; the cost is that the
 * ranks do not share host memory (the data is read once per rank). When a rank fails, the
 * launcher stops the others at once (SIGTERM), so the job ends with the failing rank's line
 * and one line of its own, never with ranks waiting on a peer that is gone.
 *
 * train.c runs one rank (train_rank_run) and joins it to its world; this file is only the
 * launcher and its checks, which run before any rank exists. */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "rt.h"
#include "train_internal.h"

static bool train_has_reduce(const Graph *g) {
    for (int i = 0; i < g->n_nodes; i++)
        if (g->nodes[i]->op == OP_ALL_REDUCE) return true;
    return false;
}

/* the device of a data-parallel rank: the GPU device, asked by name */
bool train_world_device_ok(const Graph *g, int world, const char *flag) {
    if (!train_has_reduce(g)) {
        rt_error("%s %d: this binary was built for one GPU (its update averages no gradients): "
                 "rebuild it with fp8c build --gpus N", flag, world);
        return false;
    }
    const RtDevice *d = rt_device_find("cuda");
    if (!d || !d->comm_probe) {
        rt_error("%s %d: data parallel runs on GPUs, and this binary carries no GPU device "
                 "(fp8c was built without CUDA)", flag, world);
        return false;
    }
    return true;
}

/* Runs the GPU device's comm_probe in a child, so that this process never starts CUDA. */
static bool train_probe_gpus(int gpus) {
    const RtDevice *d = rt_device_find("cuda");
    int fds[2];
    if (pipe(fds) != 0) {
        rt_error("--gpus: pipe: %s", strerror(errno));
        return false;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        rt_error("--gpus: fork: %s", strerror(errno));
        close(fds[0]), close(fds[1]);
        return false;
    }
    if (pid == 0) {
        close(fds[0]);
        char why[512] = "";
        bool ok = d->comm_probe(gpus, why, sizeof why);
        if (!ok && write(fds[1], why, strlen(why)) < 0) _exit(2);
        _exit(ok ? 0 : 1);
    }
    close(fds[1]);
    char why[512];
    size_t len = 0;
    ssize_t got;
    while (len + 1 < sizeof why && (got = read(fds[0], why + len, sizeof why - 1 - len)) > 0)
        len += (size_t)got;
    why[len] = 0;
    close(fds[0]);
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return true;
    rt_error("--gpus %d: %s", gpus, *why ? why : "the GPU probe failed");
    return false;
}

/* --gpus N: N ranks as child processes, and their fate as this process's exit status. */
int train_launch(Graph *g, const TrainOptions *o) {
    if (!train_world_device_ok(g, o->gpus, "--gpus") || !train_probe_gpus(o->gpus)) return 1;
    char dir[] = "/tmp/fp8c-comm-XXXXXX";
    if (!mkdtemp(dir)) {
        rt_error("--gpus: cannot make a temp directory for the NCCL id: %s", strerror(errno));
        return 1;
    }
    char file[64];
    snprintf(file, sizeof file, "%s/nccl-id", dir);
    pid_t *pids = calloc((size_t)o->gpus, sizeof *pids);
    if (!pids) return 1;
    TrainOptions c = *o;
    c.gpus = 0;
    c.world_size = o->gpus;
    c.comm_file = file;
    int status = 0, started = 0;
    pid_t launcher = getpid();
    fflush(NULL);
    for (int r = 0; r < o->gpus; r++) {
        pid_t pid = fork();
        if (pid < 0) {
            rt_error("--gpus: fork of rank %d: %s", r, strerror(errno));
            status = 1;
            break;
        }
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGTERM);   /* no rank outlives its launcher */
            if (getppid() != launcher) _exit(1);   /* it died before prctl */
            c.rank = r;
            int rc = train_rank_run(g, &c);
            fflush(NULL);
            _exit(rc);
        }
        pids[started++] = pid;
    }
    /* wait for every rank; the first that fails stops the others */
    int alive = started;
    if (status) {
        for (int k = 0; k < started; k++) kill(pids[k], SIGTERM);
    }
    while (alive > 0) {
        int st = 0;
        pid_t pid = waitpid(-1, &st, 0);
        if (pid < 0) {
            if (errno == EINTR) continue;
            break;
        }
        int r = -1;
        for (int k = 0; k < started; k++)
            if (pids[k] == pid) r = k;
        if (r < 0) continue;
        pids[r] = 0;
        alive--;
        bool failed = !WIFEXITED(st) || WEXITSTATUS(st) != 0;
        if (failed && !status) {
            if (WIFSIGNALED(st))
                rt_error("rank %d of %d was killed by signal %d: stopping the other ranks", r,
                         o->gpus, WTERMSIG(st));
            else
                rt_error("rank %d of %d failed (exit status %d): stopping the other ranks", r,
                         o->gpus, WEXITSTATUS(st));
            status = WIFEXITED(st) ? WEXITSTATUS(st) : 1;
            for (int k = 0; k < started; k++)
                if (pids[k]) kill(pids[k], SIGTERM);
        }
    }
    free(pids);
    unlink(file);   /* rank 0 removes it once the ranks met; not when they never did */
    rmdir(dir);
    return status;
}
