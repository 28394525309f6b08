/*
 * fake_nvml.c — a stand-in for libnvidia-ml.so.1, for tests and the `--local`
 * demo of resild. The real nvidia-ml-py binding loads it by name through
 * LD_LIBRARY_PATH and resolves each symbol on first use, so everything above
 * this file (binding, probe, daemon) runs unmodified on a machine with no GPU.
 *
 * Build: see resild/health/fakenvml.py (build_fake_nvml), roughly
 *   gcc -shared -fPIC -O1 -o libnvidia-ml.so.1 fake_nvml.c -lpthread
 * With -DFAKE_NVML_OLD_DRIVER the library omits nvmlDeviceGetRemappedRows,
 * nvmlDeviceGetCurrentClocksEventReasons and nvmlDeviceGetFieldValues, like a
 * pre-R460 driver: the binding then raises NVMLError_FunctionNotFound.
 *
 * ---------------------------------------------------------------------------
 * CONTROL FILE
 * ---------------------------------------------------------------------------
 * Path: environment variable FAKE_NVML_CONTROL (read at every call; no file or
 * no variable = one healthy GPU). The file is re-parsed whenever its size,
 * mtime or inode changes; write it atomically (write a temp file, rename it
 * over) or append to it. The file describes the whole state: every re-parse
 * starts again from the defaults below. One directive per line, '#' starts a
 * comment, numbers accept 0x.. hex. <gpu> is an index or '*' (all GPUs).
 *
 *   gpus <n>                    number of GPUs (default 1, at most 64)
 *   driver <version>            nvmlSystemGetDriverVersion (default 550.54.15)
 *   init_error <code>           nvmlInit* fails with this nvmlReturn_t
 *   set <gpu> <key> <value>     per-GPU state; keys and defaults:
 *       temp <C> (40)                power_w <W> (100)
 *       ecc_uncorrected <n> (0)      ecc_corrected <n> (0)   volatile = aggregate
 *       remap_corrected <n> (0)      remap_uncorrected <n> (0)
 *       remap_pending <0|1> (0)      remap_failure <0|1> (0)
 *       nvlinks <n> (18)             links 0..n-1 exist and are up;
 *                                    0 = NVLink not supported
 *       nvlink <link> <0|1>          one link down/up (two values)
 *       pcie_replays <n> (0)
 *       pcie_width <lanes> (16)      pcie_width_max <lanes> (16)   link width now / at most
 *       pcie_gen <n> (5)             pcie_gen_max <n> (5)          link generation now / at most
 *       clocks_event <mask> (0)      clock event (throttle) reason bits
 *       recovery_action <n> (0)      field 230 NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
 *       supported_events <mask> (0xc00b = SBE|DBE|Xid|Unavailable|Recovery)
 *       pci_bus <n> ((index+1)*0x10) bus number in the PCI bus id
 *       lost <0|1>                   every call on the GPU returns 15 GPU_IS_LOST
 *       reset_required <0|1>         every call on the GPU returns 16
 *       hang_ms <ms> (0)             every call on the GPU sleeps first
 *                                    (outside the library lock)
 *   fail <gpu> <function|*> <code>
 *                               that device function (exact NVML symbol name,
 *                               or * for all) returns <code> on that GPU,
 *                               e.g. `fail 0 nvmlDeviceGetTemperature 999`,
 *                               `fail 1 nvmlDeviceGetRemappedRows 3` (NOT_SUPPORTED)
 *   event <gpu> xid <code>      events, delivered once each and in file order
 *   event <gpu> dbe             by nvmlEventSetWait_v2 to every event set that
 *   event <gpu> sbe             has the GPU and event type registered.
 *   event <gpu> unavailable     An event set only sees events appended after
 *   event <gpu> recovery <act>  nvmlEventSetCreate (events before registration
 *   event <gpu> raw <type> <data>  are lost, as with the real driver).
 *   event <gpu> wait_error <code>  nvmlEventSetWait_v2 returns <code> once
 *                               instead of an event (e.g. 15: a GPU fell off
 *                               the bus; the driver does not say which).
 *
 * nvmlEventSetWait_v2 waits up to its timeout and returns NVML_ERROR_TIMEOUT (10)
 * when nothing new arrived. It sleeps on inotify (the control file's directory) and
 * re-reads the file when something there changed, as the driver sleeps until an event:
 * an idle daemon's event thread costs no wake-ups (it runs beside the trainers in the
 * benchmarks). Without inotify it re-reads the file every ~10 ms. Unknown lines
 * are ignored (a message goes to stderr once per parse).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <libgen.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define MAX_LINKS 36
#define MAX_EVENTS 4096
#define MAX_FAILS 128
#define FIELD_RECOVERY_ACTION 230
#define DEFAULT_SUPPORTED_EVENTS 0xc00bULL

struct fake_device {
    int index;
    unsigned temp, power_mw;
    unsigned long long ecc_unc, ecc_corr;
    unsigned remap_corr, remap_unc, remap_pending, remap_failure;
    int nvlinks;
    unsigned char link_up[MAX_LINKS];
    unsigned pcie_replays;
    unsigned pcie_width, pcie_width_max, pcie_gen, pcie_gen_max;
    unsigned long long clocks_event;
    unsigned recovery_action;
    unsigned long long supported_events;
    unsigned pci_bus;
    int lost, reset_required;
    unsigned hang_ms;
};
typedef struct fake_device *nvmlDevice_t;

struct fake_fail { int gpu; char fn[64]; int code; };
struct fake_event { int gpu; unsigned long long type, data; };

#define SET_MAGIC 0x5e7e7e75u
struct fake_event_set {
    unsigned magic;
    int cursor;                                /* next event index to look at */
    unsigned long long mask[MAX_GPUS];
    int watch_fd;                              /* inotify on the control file's directory, or -1 */
};
typedef struct fake_event_set *nvmlEventSet_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

typedef union {
    double dVal;
    unsigned int uiVal;
    unsigned long ulVal;
    unsigned long long ullVal;
    signed long long sllVal;
    signed int siVal;
    unsigned short usVal;
} nvmlValue_t;

typedef struct {
    unsigned int fieldId;
    unsigned int scopeId;
    long long timestamp;
    long long latencyUsec;
    int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_init_count;
static int g_ngpus = 1;
static char g_driver[80] = "550.54.15";
static int g_init_error;
static struct fake_device g_devs[MAX_GPUS];
static struct fake_fail g_fails[MAX_FAILS];
static int g_nfails;
static struct fake_event g_events[MAX_EVENTS];
static int g_nevents;
/* identity of the last parsed control file; parsed_once=0 forces a parse */
static int g_parsed_once;
static off_t g_size;
static struct timespec g_mtime;
static ino_t g_ino;

static void reset_defaults(void) {
    g_ngpus = 1;
    snprintf(g_driver, sizeof g_driver, "%s", "550.54.15");
    g_init_error = 0;
    g_nfails = 0;
    g_nevents = 0;
    for (int i = 0; i < MAX_GPUS; i++) {
        struct fake_device *d = &g_devs[i];
        memset(d, 0, sizeof *d);
        d->index = i;
        d->temp = 40;
        d->power_mw = 100000;
        d->nvlinks = 18;
        d->pcie_width = d->pcie_width_max = 16;
        d->pcie_gen = d->pcie_gen_max = 5;
        for (int l = 0; l < MAX_LINKS; l++) d->link_up[l] = 1;
        d->supported_events = DEFAULT_SUPPORTED_EVENTS;
        d->pci_bus = (unsigned)((i + 1) * 0x10);
    }
}

static unsigned long long num(const char *s) { return s ? strtoull(s, NULL, 0) : 0; }

/* Parses a <gpu> token into [lo, hi); returns 0 if invalid. */
static int gpu_range(const char *tok, int *lo, int *hi) {
    if (!tok) return 0;
    if (strcmp(tok, "*") == 0) { *lo = 0; *hi = MAX_GPUS; return 1; }
    char *end;
    long v = strtol(tok, &end, 0);
    if (*end || v < 0 || v >= MAX_GPUS) return 0;
    *lo = (int)v; *hi = (int)v + 1;
    return 1;
}

static int apply_set(struct fake_device *d, const char *key, const char *v1, const char *v2) {
    if (!key || !v1) return 0;
    unsigned long long v = num(v1);
    if (!strcmp(key, "temp")) d->temp = (unsigned)v;
    else if (!strcmp(key, "power_w")) d->power_mw = (unsigned)(v * 1000);
    else if (!strcmp(key, "ecc_uncorrected")) d->ecc_unc = v;
    else if (!strcmp(key, "ecc_corrected")) d->ecc_corr = v;
    else if (!strcmp(key, "remap_corrected")) d->remap_corr = (unsigned)v;
    else if (!strcmp(key, "remap_uncorrected")) d->remap_unc = (unsigned)v;
    else if (!strcmp(key, "remap_pending")) d->remap_pending = (unsigned)v;
    else if (!strcmp(key, "remap_failure")) d->remap_failure = (unsigned)v;
    else if (!strcmp(key, "nvlinks")) d->nvlinks = v > MAX_LINKS ? MAX_LINKS : (int)v;
    else if (!strcmp(key, "nvlink")) {
        if (!v2 || v >= MAX_LINKS) return 0;
        d->link_up[v] = num(v2) ? 1 : 0;
    }
    else if (!strcmp(key, "pcie_replays")) d->pcie_replays = (unsigned)v;
    else if (!strcmp(key, "pcie_width")) d->pcie_width = (unsigned)v;
    else if (!strcmp(key, "pcie_width_max")) d->pcie_width_max = (unsigned)v;
    else if (!strcmp(key, "pcie_gen")) d->pcie_gen = (unsigned)v;
    else if (!strcmp(key, "pcie_gen_max")) d->pcie_gen_max = (unsigned)v;
    else if (!strcmp(key, "clocks_event")) d->clocks_event = v;
    else if (!strcmp(key, "recovery_action")) d->recovery_action = (unsigned)v;
    else if (!strcmp(key, "supported_events")) d->supported_events = v;
    else if (!strcmp(key, "pci_bus")) d->pci_bus = (unsigned)v;
    else if (!strcmp(key, "lost")) d->lost = v != 0;
    else if (!strcmp(key, "reset_required")) d->reset_required = v != 0;
    else if (!strcmp(key, "hang_ms")) d->hang_ms = (unsigned)v;
    else return 0;
    return 1;
}

static int parse_event(int gpu, char **tok, int ntok) {
    if (g_nevents >= MAX_EVENTS || ntok < 3) return 0;
    struct fake_event *e = &g_events[g_nevents];
    e->gpu = gpu;
    e->data = 0;
    const char *kind = tok[2];
    if (!strcmp(kind, "xid") && ntok >= 4) { e->type = 0x8; e->data = num(tok[3]); }
    else if (!strcmp(kind, "dbe")) e->type = 0x2;
    else if (!strcmp(kind, "sbe")) e->type = 0x1;
    else if (!strcmp(kind, "unavailable")) e->type = 0x4000;
    else if (!strcmp(kind, "recovery") && ntok >= 4) { e->type = 0x8000; e->data = num(tok[3]); }
    else if (!strcmp(kind, "raw") && ntok >= 5) { e->type = num(tok[3]); e->data = num(tok[4]); }
    else if (!strcmp(kind, "wait_error") && ntok >= 4) { e->type = 0; e->data = num(tok[3]); }
    else return 0;
    g_nevents++;
    return 1;
}

static void parse_line(char *line, int lineno) {
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char *tok[8];
    int ntok = 0;
    char *save = NULL;
    for (char *t = strtok_r(line, " \t\r\n", &save); t && ntok < 8; t = strtok_r(NULL, " \t\r\n", &save))
        tok[ntok++] = t;
    if (ntok == 0) return;
    int ok = 0, lo, hi;
    if (!strcmp(tok[0], "gpus") && ntok >= 2) {
        unsigned long long n = num(tok[1]);
        g_ngpus = n > MAX_GPUS ? MAX_GPUS : (int)n;
        ok = 1;
    } else if (!strcmp(tok[0], "driver") && ntok >= 2) {
        snprintf(g_driver, sizeof g_driver, "%s", tok[1]);
        ok = 1;
    } else if (!strcmp(tok[0], "init_error") && ntok >= 2) {
        g_init_error = (int)num(tok[1]);
        ok = 1;
    } else if (!strcmp(tok[0], "set") && ntok >= 4 && gpu_range(tok[1], &lo, &hi)) {
        ok = 1;
        for (int i = lo; i < hi; i++)
            ok &= apply_set(&g_devs[i], tok[2], tok[3], ntok >= 5 ? tok[4] : NULL);
    } else if (!strcmp(tok[0], "fail") && ntok >= 4 && g_nfails < MAX_FAILS
               && (gpu_range(tok[1], &lo, &hi))) {
        struct fake_fail *f = &g_fails[g_nfails++];
        f->gpu = strcmp(tok[1], "*") == 0 ? -1 : lo;
        snprintf(f->fn, sizeof f->fn, "%s", tok[2]);
        f->code = (int)num(tok[3]);
        ok = 1;
    } else if (!strcmp(tok[0], "event") && gpu_range(tok[1], &lo, &hi) && hi == lo + 1) {
        ok = parse_event(lo, tok, ntok);
    }
    if (!ok) fprintf(stderr, "fake_nvml: control line %d not understood\n", lineno);
}

/* Re-parses the control file if it changed. Caller holds g_mu. */
static void maybe_reload(void) {
    const char *path = getenv("FAKE_NVML_CONTROL");
    struct stat st;
    if (!path || !*path || stat(path, &st) != 0) {
        if (g_parsed_once && g_size == -1) return;
        reset_defaults();
        g_parsed_once = 1;
        g_size = -1;
        return;
    }
    if (g_parsed_once && st.st_size == g_size && st.st_ino == g_ino
        && st.st_mtim.tv_sec == g_mtime.tv_sec && st.st_mtim.tv_nsec == g_mtime.tv_nsec)
        return;
    FILE *f = fopen(path, "r");
    if (!f) return;  /* keep the old state; try again on the next call */
    reset_defaults();
    char line[512];
    int lineno = 0;
    while (fgets(line, sizeof line, f)) parse_line(line, ++lineno);
    fclose(f);
    g_parsed_once = 1;
    g_size = st.st_size;
    g_ino = st.st_ino;
    g_mtime = st.st_mtim;
}

static void sleep_ms(unsigned ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

/* An inotify descriptor watching the directory of FAKE_NVML_CONTROL (the writer
   replaces the file by a rename), or -1. Set up when the event set is created, so a
   change after that is queued on the descriptor and never missed. */
static int watch_control_dir(void) {
    const char *path = getenv("FAKE_NVML_CONTROL");
    if (!path || !*path) return -1;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0) return -1;
    if (inotify_add_watch(fd, dirname(dir),
                          IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE | IN_DELETE | IN_MODIFY | IN_ATTRIB) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Sleep until the control file may have changed, or left_s passed. */
static void wait_for_change(int watch_fd, double left_s) {
    unsigned ms = left_s < 0.010 ? (unsigned)(left_s * 1000) + 1 : 10;
    if (watch_fd < 0) {
        sleep_ms(ms);
        return;
    }
    /* At most 1 s at a time: a safety net for a change inotify cannot see. */
    int wait_ms = left_s > 1.0 ? 1000 : (int)(left_s * 1000) + 1;
    struct pollfd p = {watch_fd, POLLIN, 0};
    if (poll(&p, 1, wait_ms) > 0) {
        char buf[4096];
        while (read(watch_fd, buf, sizeof buf) > 0) {}
    }
}

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int dev_index(nvmlDevice_t d) {
    if (d < &g_devs[0] || d >= &g_devs[MAX_GPUS]) return -1;
    int i = (int)(d - &g_devs[0]);
    return i < g_ngpus ? i : -1;
}

/* Per-GPU fault injection; caller holds g_mu. */
static nvmlReturn_t injected(int idx, const char *fn) {
    struct fake_device *d = &g_devs[idx];
    if (d->lost) return NVML_ERROR_GPU_IS_LOST;
    if (d->reset_required) return NVML_ERROR_RESET_REQUIRED;
    for (int i = 0; i < g_nfails; i++) {
        struct fake_fail *f = &g_fails[i];
        if ((f->gpu == -1 || f->gpu == idx) && (!strcmp(f->fn, "*") || !strcmp(f->fn, fn)))
            return f->code;
    }
    return NVML_SUCCESS;
}

/*
 * Common entry of every per-device call. On NVML_SUCCESS it returns with g_mu
 * held (release with DEV_RETURN); otherwise g_mu is released. The hang sleeps
 * without the lock so one hung GPU does not stall calls on the others.
 */
static nvmlReturn_t dev_enter(nvmlDevice_t dev, const char *fn, int *idx_out) {
    pthread_mutex_lock(&g_mu);
    maybe_reload();
    if (g_init_count == 0) { pthread_mutex_unlock(&g_mu); return NVML_ERROR_UNINITIALIZED; }
    int idx = dev_index(dev);
    if (idx < 0) { pthread_mutex_unlock(&g_mu); return NVML_ERROR_INVALID_ARGUMENT; }
    unsigned hang = g_devs[idx].hang_ms;
    if (hang) {
        pthread_mutex_unlock(&g_mu);
        sleep_ms(hang);
        pthread_mutex_lock(&g_mu);
        maybe_reload();
    }
    nvmlReturn_t r = injected(idx, fn);
    if (r != NVML_SUCCESS) { pthread_mutex_unlock(&g_mu); return r; }
    *idx_out = idx;
    return NVML_SUCCESS;
}

#define DEV_BEGIN(dev)                                          \
    int idx;                                                    \
    do {                                                        \
        nvmlReturn_t r_ = dev_enter((dev), __func__, &idx);     \
        if (r_ != NVML_SUCCESS) return r_;                      \
    } while (0);                                                \
    struct fake_device *d = &g_devs[idx];                       \
    (void)d
#define DEV_RETURN(ret) do { pthread_mutex_unlock(&g_mu); return (ret); } while (0)

/* ---- library ---------------------------------------------------------- */

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&g_mu);
    maybe_reload();
    nvmlReturn_t r = g_init_error;
    if (r == NVML_SUCCESS) g_init_count++;
    pthread_mutex_unlock(&g_mu);
    return r;
}

API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
API nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_mu);
    nvmlReturn_t r = g_init_count > 0 ? NVML_SUCCESS : NVML_ERROR_UNINITIALIZED;
    if (g_init_count > 0) g_init_count--;
    pthread_mutex_unlock(&g_mu);
    return r;
}

API const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 13: return "Function Not Found";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    default: return "Unknown Error";
    }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    pthread_mutex_lock(&g_mu);
    maybe_reload();
    nvmlReturn_t r = NVML_SUCCESS;
    if (g_init_count == 0) r = NVML_ERROR_UNINITIALIZED;
    else if (!version) r = NVML_ERROR_INVALID_ARGUMENT;
    else if (strlen(g_driver) + 1 > length) r = NVML_ERROR_INSUFFICIENT_SIZE;
    else snprintf(version, length, "%s", g_driver);
    pthread_mutex_unlock(&g_mu);
    return r;
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    pthread_mutex_lock(&g_mu);
    maybe_reload();
    nvmlReturn_t r = NVML_SUCCESS;
    if (g_init_count == 0) r = NVML_ERROR_UNINITIALIZED;
    else if (!count) r = NVML_ERROR_INVALID_ARGUMENT;
    else *count = (unsigned)g_ngpus;
    pthread_mutex_unlock(&g_mu);
    return r;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    pthread_mutex_lock(&g_mu);
    maybe_reload();
    nvmlReturn_t r = NVML_SUCCESS;
    if (g_init_count == 0) r = NVML_ERROR_UNINITIALIZED;
    else if (!device || index >= (unsigned)g_ngpus) r = NVML_ERROR_INVALID_ARGUMENT;
    else if ((r = injected((int)index, __func__)) == NVML_SUCCESS) *device = &g_devs[index];
    pthread_mutex_unlock(&g_mu);
    return r;
}

/* ---- device queries ----------------------------------------------------- */

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    DEV_BEGIN(device);
    if (!uuid || length < 41) DEV_RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
    snprintf(uuid, length, "GPU-00000000-fa4e-0000-0000-%012x", idx);
    DEV_RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    DEV_BEGIN(device);
    const char *n = "NVIDIA H100 80GB HBM3 (fake)";
    if (!name || strlen(n) + 1 > length) DEV_RETURN(NVML_ERROR_INSUFFICIENT_SIZE);
    snprintf(name, length, "%s", n);
    DEV_RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    DEV_BEGIN(device);
    if (!pci) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    memset(pci, 0, sizeof *pci);
    pci->bus = d->pci_bus;
    pci->pciDeviceId = 0x233010de;
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", d->pci_bus & 0xff);
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", d->pci_bus & 0xff);
    DEV_RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temp) {
    DEV_BEGIN(device);
    if (!temp || sensor != 0) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *temp = d->temp;
    DEV_RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power_mw) {
    DEV_BEGIN(device);
    if (!power_mw) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *power_mw = d->power_mw;
    DEV_RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                             unsigned long long *count) {
    DEV_BEGIN(device);
    (void)counterType;  /* volatile and aggregate read the same in the fake */
    if (!count || errorType < 0 || errorType > 1) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *count = errorType == 1 ? d->ecc_unc : d->ecc_corr;
    DEV_RETURN(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
API nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                           unsigned int *uncRows, unsigned int *isPending,
                                           unsigned int *failureOccurred) {
    DEV_BEGIN(device);
    if (!corrRows || !uncRows || !isPending || !failureOccurred)
        DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *corrRows = d->remap_corr;
    *uncRows = d->remap_unc;
    *isPending = d->remap_pending;
    *failureOccurred = d->remap_failure;
    DEV_RETURN(NVML_SUCCESS);
}
#endif

API nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *isActive) {
    DEV_BEGIN(device);
    if (d->nvlinks == 0) DEV_RETURN(NVML_ERROR_NOT_SUPPORTED);
    if (!isActive || link >= (unsigned)d->nvlinks) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *isActive = d->link_up[link];
    DEV_RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t device, unsigned int *value) {
    DEV_BEGIN(device);
    if (!value) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *value = d->pcie_replays;
    DEV_RETURN(NVML_SUCCESS);
}

/* The PCIe link's width and generation, now and at most: one getter each. */
#define UINT_GETTER(fn, field)                                          \
    API nvmlReturn_t fn(nvmlDevice_t device, unsigned int *value) {     \
        DEV_BEGIN(device);                                              \
        if (!value) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);            \
        *value = d->field;                                              \
        DEV_RETURN(NVML_SUCCESS);                                       \
    }
UINT_GETTER(nvmlDeviceGetCurrPcieLinkWidth, pcie_width)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkWidth, pcie_width_max)
UINT_GETTER(nvmlDeviceGetCurrPcieLinkGeneration, pcie_gen)
UINT_GETTER(nvmlDeviceGetMaxPcieLinkGeneration, pcie_gen_max)

#ifndef FAKE_NVML_OLD_DRIVER
API nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                        unsigned long long *reasons) {
    DEV_BEGIN(device);
    if (!reasons) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *reasons = d->clocks_event;
    DEV_RETURN(NVML_SUCCESS);
}
#endif

API nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device,
                                                           unsigned long long *reasons) {
    DEV_BEGIN(device);
    if (!reasons) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *reasons = d->clocks_event;
    DEV_RETURN(NVML_SUCCESS);
}

#ifndef FAKE_NVML_OLD_DRIVER
API nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t device, int valuesCount,
                                          nvmlFieldValue_t *values) {
    DEV_BEGIN(device);
    if (!values || valuesCount < 0) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = (long long)ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
        v->latencyUsec = 0;
        if (v->fieldId == FIELD_RECOVERY_ACTION) {
            v->valueType = 1;  /* NVML_VALUE_TYPE_UNSIGNED_INT */
            v->nvmlReturn = NVML_SUCCESS;
            v->value.ullVal = 0;
            v->value.uiVal = d->recovery_action;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    DEV_RETURN(NVML_SUCCESS);
}
#endif

/* ---- events ------------------------------------------------------------- */

API nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!set) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mu);
    maybe_reload();
    nvmlReturn_t r = NVML_SUCCESS;
    if (g_init_count == 0) {
        r = NVML_ERROR_UNINITIALIZED;
    } else {
        struct fake_event_set *s = calloc(1, sizeof *s);
        if (!s) r = NVML_ERROR_UNKNOWN;
        else {
            s->magic = SET_MAGIC;
            s->cursor = g_nevents;  /* earlier events are lost, as on a real driver */
            s->watch_fd = watch_control_dir();
            *set = s;
        }
    }
    pthread_mutex_unlock(&g_mu);
    return r;
}

API nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t device,
                                                  unsigned long long *eventTypes) {
    DEV_BEGIN(device);
    if (!eventTypes) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    *eventTypes = d->supported_events;
    DEV_RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long eventTypes,
                                          nvmlEventSet_t set) {
    DEV_BEGIN(device);
    if (!set || set->magic != SET_MAGIC) DEV_RETURN(NVML_ERROR_INVALID_ARGUMENT);
    if (eventTypes & ~d->supported_events) DEV_RETURN(NVML_ERROR_NOT_SUPPORTED);
    set->mask[idx] |= eventTypes;
    DEV_RETURN(NVML_SUCCESS);
}

API nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data,
                                     unsigned int timeoutms) {
    if (!set || !data || set->magic != SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    double deadline = mono_s() + timeoutms / 1000.0;
    for (;;) {
        pthread_mutex_lock(&g_mu);
        maybe_reload();
        if (g_init_count == 0) { pthread_mutex_unlock(&g_mu); return NVML_ERROR_UNINITIALIZED; }
        if (set->cursor > g_nevents) set->cursor = g_nevents;  /* file was rewritten shorter */
        while (set->cursor < g_nevents) {
            struct fake_event *e = &g_events[set->cursor++];
            if (e->type == 0 && e->gpu < g_ngpus && set->mask[e->gpu]) {
                pthread_mutex_unlock(&g_mu);
                return (nvmlReturn_t)e->data;   /* injected wait failure */
            }
            if (e->gpu < g_ngpus && (set->mask[e->gpu] & e->type)) {
                memset(data, 0, sizeof *data);
                data->device = &g_devs[e->gpu];
                data->eventType = e->type;
                data->eventData = e->data;
                data->gpuInstanceId = 0xffffffffu;
                data->computeInstanceId = 0xffffffffu;
                pthread_mutex_unlock(&g_mu);
                return NVML_SUCCESS;
            }
        }
        pthread_mutex_unlock(&g_mu);
        double left = deadline - mono_s();
        if (left <= 0) return NVML_ERROR_TIMEOUT;
        wait_for_change(set->watch_fd, left);
    }
}

API nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    if (!set || set->magic != SET_MAGIC) return NVML_ERROR_INVALID_ARGUMENT;
    pthread_mutex_lock(&g_mu);
    set->magic = 0;
    pthread_mutex_unlock(&g_mu);
    if (set->watch_fd >= 0) close(set->watch_fd);
    free(set);
    return NVML_SUCCESS;
}
