/*
 * libamdhip64.so stand-in that simulates HIP's virtual memory management (VMM) API in
 * host memory, so kvcached's ROCm backend runs its real hip-python code path on any
 * Linux machine. The tests point hip-python at this library instead of ROCm's.
 *
 * The simulation is strict on purpose: it returns the hipError_t a real runtime returns
 * for invalid values, double maps, unmaps of unmapped ranges and unknown handles, it
 * enforces access (a mapping is PROT_NONE until hipMemSetAccess grants it, so touching
 * it early faults like a GPU would), and it holds device memory in one budget shared
 * by every process on the machine, so hipMemGetInfo answers device-wide, as the
 * conformance suite expects.
 *
 * How HIP maps onto Linux here:
 *   reservation  an anonymous PROT_NONE, MAP_NORESERVE mapping (address space only)
 *   allocation   a range of one memfd per process ("device memory"), fallocate'd so the
 *                memory is committed at hipMemCreate and punched out when it is freed
 *   map          mmap(MAP_SHARED | MAP_FIXED) of that range, PROT_NONE until set-access
 *   unmap        a PROT_NONE anonymous mapping put back over the range (it stays reserved);
 *                with HIPSTANDIN_BUG_RELEASE the allocation's own mapping is left in place,
 *                PROT_NONE, as ROCr leaves it (see "The release bug" below)
 *   budget       a small table in a shared file (HIPSTANDIN_STATE), one row per process,
 *                under flock; rows of dead processes do not count, as a driver frees a
 *                dead process's memory
 *
 * Environment (read at every call, so a test can flip a switch between calls):
 *   HIPSTANDIN_DEVICES        device count (default 1; 0 simulates "no device")
 *   HIPSTANDIN_VMM            0 to report no VMM support (default 1)
 *   HIPSTANDIN_MEMORY         device memory, e.g. 1G, 512M (default 1G; K/M/G are binary)
 *   HIPSTANDIN_GRANULARITY    allocation granularity (default 2M)
 *   HIPSTANDIN_STATE          path of the shared budget table (default /dev/shm/hipstandin-UID)
 *   HIPSTANDIN_BUG_RELEASE    1: hipMemUnmap leaves a stale mapping of the allocation at
 *                             the address it was mapped at, which keeps its memory alive
 *                             after hipMemRelease (ROCm 7.2, see below)
 *   HIPSTANDIN_BUG_SETACCESS  "tail": set-access over several mappings that do not start at
 *                             the reservation's first mapping fails with
 *                             hipErrorInvalidValue (ROCm/rocm-systems#6977);
 *                             "prefix": coverage is summed from the reservation's first
 *                             mapping whatever the pointer (ROCm/rocm-systems#2516)
 *   HIPSTANDIN_BUG_MULTI_UNMAP 1: a hipMemUnmap over several mappings unmaps them but
 *                             leaves the reservation "in use", so hipMemAddressFree fails
 *                             (ROCm/ROCR-Runtime#285)
 *   HIPSTANDIN_IGNORE_ADDRESS 1: hipMemAddressReserve never grants a requested address; it
 *                             answers hipSuccess with another one, as HIP does whenever
 *                             the requested range cannot be had. (Test hook
 *                             hipstandin_miss_requested_addresses(n) does so for the next
 *                             n requests that would have been granted.)
 *
 * The release bug, as modelled. In ROCr (ROCm 7.2) hipMemMap creates a PROT_NONE CPU
 * mapping of the allocation's DRM buffer at the mapped address, and hipMemUnmap removes
 * the GPU mapping but leaves that CPU mapping where it is, so the buffer stays referenced
 * after hipMemRelease (ROCm/legacy-rocm-build#6021, diagnosed there by AMD; the fix,
 * ROCm/rocm-systems#4363, puts an anonymous mapping back at unmap). The reference goes
 * with the CPU mapping, that is when something else replaces those addresses:
 * hipMemAddressFree of the reservation they lie in (ROCr releases the whole range), or a
 * later hipMemMap over them (its own MAP_FIXED mapping replaces the stale one). Only the
 * replaced part goes; a buffer comes back once none of its stale ranges is left. This
 * stand-in does exactly that: with the switch on, hipMemUnmap leaves the memfd mapping in
 * place (PROT_NONE) and records the stale range, and the allocation's memory is given
 * back only when it is released, unmapped everywhere and without stale ranges.
 *
 * Requested addresses, as in ROCr: hipMemAddressReserve first tries to reserve exactly the
 * requested range, and when that fails (the range, or part of it, is taken) it reserves
 * another range and still returns hipSuccess (ROCr's Runtime::VMemoryAddressReserve;
 * HIP's hipMemAddressReserve only logs that the address was not granted). The caller has
 * to compare the address it got.
 */
#define _GNU_SOURCE
#include "hipstandin.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#ifndef MAP_FIXED_NOREPLACE
#define MAP_FIXED_NOREPLACE 0x100000
#endif

#define MAX_DEVICES 8
#define ALLOC_MAGIC 0x4b564850u /* "KVHP" */
#define ARENA_SIZE ((off_t)1 << 40) /* sparse; only created allocations use memory */
#define RUNTIME_VERSION 70253211    /* reported as HIP 7.2.53211 */

/* ------------------------------------------------------------------ configuration */

static unsigned long long env_size(const char *name, unsigned long long fallback)
{
    const char *text = getenv(name);
    if (text == NULL || *text == '\0')
        return fallback;
    char *end = NULL;
    unsigned long long value = strtoull(text, &end, 10);
    switch (*end) {
    case 'k': case 'K': value <<= 10; break;
    case 'm': case 'M': value <<= 20; break;
    case 'g': case 'G': value <<= 30; break;
    case 't': case 'T': value <<= 40; break;
    default: break;
    }
    return value;
}

static int env_flag(const char *name)
{
    const char *text = getenv(name);
    return text != NULL && *text != '\0' && strcmp(text, "0") != 0;
}

static int device_count(void)
{
    unsigned long long n = env_size("HIPSTANDIN_DEVICES", 1);
    return n > MAX_DEVICES ? MAX_DEVICES : (int)n;
}

static size_t granularity(void)
{
    size_t g = env_size("HIPSTANDIN_GRANULARITY", 2u << 20);
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    /* A granularity the kernel cannot map at is a configuration error: fall back. */
    if (g < page || (g & (g - 1)) != 0)
        g = 2u << 20;
    return g;
}

static size_t device_memory(void)
{
    size_t g = granularity();
    return env_size("HIPSTANDIN_MEMORY", 1ull << 30) / g * g;
}

enum setaccess_bug { SETACCESS_OK, SETACCESS_TAIL, SETACCESS_PREFIX };

static enum setaccess_bug setaccess_bug(void)
{
    const char *mode = getenv("HIPSTANDIN_BUG_SETACCESS");
    if (mode == NULL || *mode == '\0' || strcmp(mode, "0") == 0)
        return SETACCESS_OK;
    return strcmp(mode, "prefix") == 0 ? SETACCESS_PREFIX : SETACCESS_TAIL;
}

/* ------------------------------------------------------------------ objects */

struct hipstandin_allocation {
    uint32_t magic;
    int device;
    size_t size;
    off_t offset;      /* in this process's arena memfd */
    int mappings;      /* live mappings of this allocation */
    int released;      /* hipMemRelease was called */
    struct span *stale; /* unmapped ranges still mapped on the CPU side (the release bug) */
    size_t nstale, cap;
    struct hipstandin_allocation *next;
};

struct span {
    uintptr_t va;
    size_t size;
};

struct mapping {
    uintptr_t va;
    size_t size;
    struct hipstandin_allocation *alloc;
    int access; /* hipMemAccessFlags */
    struct mapping *next; /* sorted by address */
};

struct reservation {
    uintptr_t base;
    size_t size;
    int use_count; /* what hipMemAddressFree checks; one per mapping unless bugged */
    struct mapping *mappings;
    struct reservation *next;
};

struct extent {
    off_t offset;
    size_t size;
    struct extent *next;
};

/* Counters for the tests (hipstandin_stats); not part of HIP. */
struct hipstandin_stats {
    unsigned long long reservations;
    unsigned long long mappings;
    unsigned long long allocations;      /* created and not yet freed (incl. held ones) */
    unsigned long long held_bytes;       /* released, yet held by the release bug */
    unsigned long long process_bytes;    /* device memory this process holds */
    unsigned long long unmap_calls;
    unsigned long long multi_unmap_calls; /* hipMemUnmap calls covering > 1 mapping */
    unsigned long long setaccess_calls;
    unsigned long long setaccess_rejected_by_bug;
    unsigned long long address_free_calls;
    unsigned long long address_reserve_calls;
    unsigned long long address_misses;   /* requested addresses not granted */
    unsigned long long stale_ranges;     /* left behind by unmaps under the release bug */
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_device = 0;
static struct hipstandin_allocation *g_allocs;
static struct reservation *g_reservations;
static struct extent *g_free_extents;
static int g_arena_fd = -1;
static off_t g_arena_end;
static struct hipstandin_stats g_stats;
static unsigned long g_address_misses_left; /* hipstandin_miss_requested_addresses */

/* ------------------------------------------------------------------ device-wide budget */

#define ACCT_SLOTS 256
#define ACCT_MAGIC 0x6869707374616e64ull /* "hipstand" */

struct acct_slot {
    int32_t pid;
    int32_t unused;
    uint64_t start; /* process start time, so a recycled pid is not mistaken for it */
    uint64_t bytes[MAX_DEVICES];
};

struct acct_table {
    uint64_t magic;
    struct acct_slot slot[ACCT_SLOTS];
};

static int g_acct_fd = -1;
static struct acct_table *g_acct;
static char g_acct_path[4096];
static uint64_t g_local_bytes[MAX_DEVICES]; /* fallback when the table cannot be opened */

static uint64_t process_start(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = '\0';
    /* Field 22 (starttime); counting starts after the command name, which may hold spaces. */
    char *p = strrchr(buf, ')');
    if (p == NULL)
        return 0;
    int field = 2;
    for (; *p != '\0' && field < 22; p++)
        if (*p == ' ')
            field++;
    return strtoull(p, NULL, 10);
}

static void acct_open(void)
{
    char path[sizeof g_acct_path];
    const char *configured = getenv("HIPSTANDIN_STATE");
    if (configured != NULL && *configured != '\0')
        snprintf(path, sizeof path, "%s", configured);
    else
        snprintf(path, sizeof path, "/dev/shm/hipstandin-%d", (int)getuid());
    if (g_acct != NULL && strcmp(path, g_acct_path) == 0)
        return;
    if (g_acct != NULL) {
        munmap(g_acct, sizeof *g_acct);
        close(g_acct_fd);
        g_acct = NULL;
        g_acct_fd = -1;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0)
        return;
    struct stat st;
    if (fstat(fd, &st) != 0 || ((size_t)st.st_size < sizeof *g_acct &&
                                ftruncate(fd, sizeof *g_acct) != 0)) {
        close(fd);
        return;
    }
    void *table = mmap(NULL, sizeof *g_acct, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (table == MAP_FAILED) {
        close(fd);
        return;
    }
    g_acct = table;
    g_acct_fd = fd;
    snprintf(g_acct_path, sizeof g_acct_path, "%s", path);
}

static int slot_alive(const struct acct_slot *slot)
{
    if (slot->pid <= 0)
        return 0;
    if (kill(slot->pid, 0) != 0 && errno != EPERM)
        return 0;
    return process_start(slot->pid) == slot->start;
}

/* The calling process's row; claims a free or dead one. Under the table lock. */
static struct acct_slot *acct_own_slot(void)
{
    pid_t pid = getpid();
    uint64_t start = process_start(pid);
    struct acct_slot *free_slot = NULL;
    for (int i = 0; i < ACCT_SLOTS; i++) {
        struct acct_slot *slot = &g_acct->slot[i];
        if (slot->pid == pid && slot->start == start)
            return slot;
        if (free_slot == NULL && !slot_alive(slot))
            free_slot = slot;
    }
    if (free_slot != NULL) {
        memset(free_slot, 0, sizeof *free_slot);
        free_slot->pid = pid;
        free_slot->start = start;
    }
    return free_slot;
}

static uint64_t acct_used_locked(int device)
{
    if (g_acct == NULL)
        return g_local_bytes[device];
    if (g_acct->magic != ACCT_MAGIC) {
        memset(g_acct, 0, sizeof *g_acct);
        g_acct->magic = ACCT_MAGIC;
    }
    uint64_t used = 0;
    for (int i = 0; i < ACCT_SLOTS; i++) {
        struct acct_slot *slot = &g_acct->slot[i];
        if (slot->pid == 0)
            continue;
        if (slot_alive(slot))
            used += slot->bytes[device];
        else
            memset(slot, 0, sizeof *slot); /* a dead process's memory comes back */
    }
    return used;
}

/* Charge `size` bytes of `device` to this process; hipErrorOutOfMemory past the budget. */
static hipError_t acct_charge(int device, size_t size)
{
    acct_open();
    if (g_acct == NULL) {
        if (g_local_bytes[device] + size > device_memory())
            return hipErrorOutOfMemory;
        g_local_bytes[device] += size;
        return hipSuccess;
    }
    flock(g_acct_fd, LOCK_EX);
    hipError_t status = hipErrorOutOfMemory;
    struct acct_slot *slot = NULL;
    if (acct_used_locked(device) + size <= device_memory() &&
        (slot = acct_own_slot()) != NULL) {
        slot->bytes[device] += size;
        status = hipSuccess;
    }
    flock(g_acct_fd, LOCK_UN);
    return status;
}

static void acct_uncharge(int device, size_t size)
{
    acct_open();
    if (g_acct == NULL) {
        g_local_bytes[device] -= size;
        return;
    }
    flock(g_acct_fd, LOCK_EX);
    struct acct_slot *slot = acct_own_slot();
    if (slot != NULL)
        slot->bytes[device] -= size < slot->bytes[device] ? size : slot->bytes[device];
    flock(g_acct_fd, LOCK_UN);
}

static uint64_t acct_used(int device)
{
    acct_open();
    if (g_acct == NULL)
        return g_local_bytes[device];
    flock(g_acct_fd, LOCK_EX);
    uint64_t used = acct_used_locked(device);
    flock(g_acct_fd, LOCK_UN);
    return used;
}

/* ------------------------------------------------------------------ the arena */

static int arena_fd(void)
{
    if (g_arena_fd < 0) {
        g_arena_fd = memfd_create("hipstandin-device-memory", MFD_CLOEXEC);
        if (g_arena_fd >= 0 && ftruncate(g_arena_fd, ARENA_SIZE) != 0) {
            close(g_arena_fd);
            g_arena_fd = -1;
        }
    }
    return g_arena_fd;
}

/* A file range of `size` bytes, committed; -1 when the host cannot back it. */
static off_t arena_take(size_t size)
{
    int fd = arena_fd();
    if (fd < 0)
        return -1;
    off_t offset = -1;
    for (struct extent **link = &g_free_extents; *link != NULL; link = &(*link)->next) {
        struct extent *e = *link;
        if (e->size < size)
            continue;
        offset = e->offset;
        e->offset += (off_t)size;
        e->size -= size;
        if (e->size == 0) {
            *link = e->next;
            free(e);
        }
        break;
    }
    if (offset < 0) {
        if (g_arena_end + (off_t)size > ARENA_SIZE)
            return -1;
        offset = g_arena_end;
        g_arena_end += (off_t)size;
    }
    if (fallocate(fd, 0, offset, (off_t)size) != 0) {
        fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, (off_t)size);
        struct extent *e = malloc(sizeof *e);
        if (e != NULL) {
            *e = (struct extent){offset, size, g_free_extents};
            g_free_extents = e;
        }
        return -1;
    }
    return offset;
}

static void arena_give_back(off_t offset, size_t size)
{
    /* Punching the hole is what returns the memory to the kernel. */
    fallocate(g_arena_fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, (off_t)size);
    struct extent *e = malloc(sizeof *e);
    if (e != NULL) {
        *e = (struct extent){offset, size, g_free_extents};
        g_free_extents = e;
    }
}

/* ------------------------------------------------------------------ lookups */

static struct hipstandin_allocation *find_alloc(hipMemGenericAllocationHandle_t handle)
{
    /* Never dereference a pointer we did not hand out: a bad handle is an error code. */
    for (struct hipstandin_allocation *a = g_allocs; a != NULL; a = a->next)
        if (a == handle && a->magic == ALLOC_MAGIC && !a->released)
            return a;
    return NULL;
}

static struct reservation *find_reservation(uintptr_t va, size_t size)
{
    for (struct reservation *r = g_reservations; r != NULL; r = r->next)
        if (va >= r->base && va - r->base < r->size && size <= r->size - (va - r->base))
            return r;
    return NULL;
}

/* The mappings that exactly tile [va, va + size), starting with one that begins at va.
 * Returns the first one (NULL if they do not) and how many there are. */
static struct mapping *covering(struct reservation *r, uintptr_t va, size_t size, int *count)
{
    struct mapping *m = r->mappings;
    while (m != NULL && m->va < va)
        m = m->next;
    if (m == NULL || m->va != va)
        return NULL;
    struct mapping *first = m;
    uintptr_t cursor = va;
    int n = 0;
    while (m != NULL && m->va == cursor && cursor - va < size) {
        cursor += m->size;
        n++;
        m = m->next;
    }
    if (cursor - va != size)
        return NULL;
    *count = n;
    return first;
}

/* ------------------------------------------------------------------ allocation lifetime */

/* Record that [va, va + size) still maps `a` on the CPU side after its unmap. */
static void add_stale(struct hipstandin_allocation *a, uintptr_t va, size_t size)
{
    if (a->nstale == a->cap) {
        size_t cap = a->cap ? 2 * a->cap : 4;
        struct span *stale = realloc(a->stale, cap * sizeof *stale);
        if (stale == NULL)
            return; /* out of host memory: forget the hold rather than fail the unmap */
        a->stale = stale;
        a->cap = cap;
    }
    a->stale[a->nstale++] = (struct span){va, size};
    g_stats.stale_ranges++;
}

/* [va, va + size) was replaced (freed, or mapped again): whatever stale mapping of `a`
 * lay there is gone. A stale range that only partly overlaps keeps its other part(s). */
static void cut_stale(struct hipstandin_allocation *a, uintptr_t va, size_t size)
{
    uintptr_t end = va + size;
    for (size_t i = 0; i < a->nstale;) {
        struct span old = a->stale[i];
        uintptr_t old_end = old.va + old.size;
        if (old_end <= va || old.va >= end) {
            i++;
            continue;
        }
        a->stale[i] = a->stale[--a->nstale]; /* drop it, then put back what survives */
        g_stats.stale_ranges--;
        if (old.va < va)
            add_stale(a, old.va, va - old.va);
        if (old_end > end)
            add_stale(a, end, old_end - end);
        /* what was added lies outside [va, end): the loop skips it, and index i now
         * holds an entry not yet looked at */
    }
}

/* Free the memory of a released allocation once nothing keeps it alive. */
static void maybe_destroy(struct hipstandin_allocation *a)
{
    if (!a->released || a->mappings > 0 || a->nstale > 0)
        return;
    for (struct hipstandin_allocation **link = &g_allocs; *link != NULL;
         link = &(*link)->next)
        if (*link == a) {
            *link = a->next;
            break;
        }
    arena_give_back(a->offset, a->size);
    acct_uncharge(a->device, a->size);
    g_stats.allocations--;
    g_stats.process_bytes -= a->size;
    a->magic = 0;
    free(a->stale);
    free(a);
}

/* Something else now occupies [va, va + size): stale mappings there are gone, and the
 * allocations they kept alive may go with them. Under g_lock. */
static void replace_range(uintptr_t va, size_t size)
{
    for (struct hipstandin_allocation *a = g_allocs, *next; a != NULL; a = next) {
        next = a->next;
        if (a->nstale == 0)
            continue;
        cut_stale(a, va, size);
        maybe_destroy(a);
    }
}

/* ------------------------------------------------------------------ fork */

/* A forked child starts with no HIP state, as with a real runtime: it must not share the
 * parent's arena offsets or budget row. The parent's objects are simply forgotten. The
 * lock is held across fork() so the child never inherits it mid-update. */
static void before_fork(void)
{
    pthread_mutex_lock(&g_lock);
}

static void after_fork_in_parent(void)
{
    pthread_mutex_unlock(&g_lock);
}

static void after_fork_in_child(void)
{
    g_allocs = NULL;
    g_reservations = NULL;
    g_free_extents = NULL;
    g_arena_fd = -1; /* the inherited descriptor stays open but unused */
    g_arena_end = 0;
    g_acct = NULL;
    g_acct_fd = -1;
    g_acct_path[0] = '\0';
    memset(&g_stats, 0, sizeof g_stats);
    g_address_misses_left = 0;
    memset(g_local_bytes, 0, sizeof g_local_bytes);
    pthread_mutex_init(&g_lock, NULL);
}

__attribute__((constructor)) static void install_fork_handler(void)
{
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}

/* ================================================================== the HIP API */

HIPSTANDIN_EXPORT const char *hipGetErrorName(hipError_t error)
{
    return hipstandin_error_name(error);
}

HIPSTANDIN_EXPORT const char *hipGetErrorString(hipError_t error)
{
    return hipstandin_error_string(error);
}

HIPSTANDIN_EXPORT hipError_t hipInit(unsigned int flags)
{
    if (flags != 0)
        return hipErrorInvalidValue;
    return device_count() > 0 ? hipSuccess : hipErrorNoDevice;
}

HIPSTANDIN_EXPORT hipError_t hipDriverGetVersion(int *version)
{
    if (version == NULL)
        return hipErrorInvalidValue;
    *version = RUNTIME_VERSION;
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipRuntimeGetVersion(int *version)
{
    return hipDriverGetVersion(version);
}

HIPSTANDIN_EXPORT hipError_t hipGetDeviceCount(int *count)
{
    if (count == NULL)
        return hipErrorInvalidValue;
    *count = device_count();
    return *count > 0 ? hipSuccess : hipErrorNoDevice;
}

static hipError_t check_device(int device)
{
    int n = device_count();
    if (n == 0)
        return hipErrorNoDevice;
    return device >= 0 && device < n ? hipSuccess : hipErrorInvalidDevice;
}

HIPSTANDIN_EXPORT hipError_t hipDeviceGet(hipDevice_t *device, int ordinal)
{
    if (device == NULL)
        return hipErrorInvalidValue;
    hipError_t status = check_device(ordinal);
    if (status == hipSuccess)
        *device = ordinal;
    return status;
}

HIPSTANDIN_EXPORT hipError_t hipSetDevice(int device)
{
    hipError_t status = check_device(device);
    if (status == hipSuccess)
        t_device = device;
    return status;
}

HIPSTANDIN_EXPORT hipError_t hipGetDevice(int *device)
{
    if (device == NULL)
        return hipErrorInvalidValue;
    if (device_count() == 0)
        return hipErrorNoDevice;
    *device = t_device;
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipDeviceSynchronize(void)
{
    return device_count() > 0 ? hipSuccess : hipErrorNoDevice;
}

HIPSTANDIN_EXPORT hipError_t hipDeviceGetAttribute(int *value, int attribute, int device)
{
    if (value == NULL)
        return hipErrorInvalidValue;
    hipError_t status = check_device(device);
    if (status != hipSuccess)
        return status;
    switch (attribute) {
    case HIPSTANDIN_ATTR_VMM:
        *value = env_size("HIPSTANDIN_VMM", 1) != 0;
        return hipSuccess;
    case HIPSTANDIN_ATTR_INTEGRATED:
        *value = 1; /* its "device memory" is host memory, as on an APU */
        return hipSuccess;
    case HIPSTANDIN_ATTR_CC_MAJOR:
        *value = 9;
        return hipSuccess;
    case HIPSTANDIN_ATTR_CC_MINOR:
        *value = 4;
        return hipSuccess;
    case HIPSTANDIN_ATTR_SM_COUNT:
        *value = 1;
        return hipSuccess;
    default:
        return hipErrorInvalidValue;
    }
}

HIPSTANDIN_EXPORT hipError_t hipDeviceGetName(char *name, int len, hipDevice_t device)
{
    if (name == NULL || len <= 0)
        return hipErrorInvalidValue;
    hipError_t status = check_device(device);
    if (status == hipSuccess)
        snprintf(name, (size_t)len, "kvcached HIP stand-in %d (host memory)", device);
    return status;
}

HIPSTANDIN_EXPORT hipError_t hipDeviceTotalMem(size_t *bytes, hipDevice_t device)
{
    if (bytes == NULL)
        return hipErrorInvalidValue;
    hipError_t status = check_device(device);
    if (status == hipSuccess)
        *bytes = device_memory();
    return status;
}

HIPSTANDIN_EXPORT hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    if (free_bytes == NULL || total_bytes == NULL)
        return hipErrorInvalidValue;
    hipError_t status = check_device(t_device);
    if (status != hipSuccess)
        return status;
    pthread_mutex_lock(&g_lock);
    uint64_t used = acct_used(t_device);
    pthread_mutex_unlock(&g_lock);
    size_t total = device_memory();
    *total_bytes = total;
    *free_bytes = used >= total ? 0 : total - (size_t)used;
    return hipSuccess;
}

static hipError_t check_prop(const hipMemAllocationProp *prop)
{
    if (prop == NULL || prop->type != hipMemAllocationTypePinned)
        return hipErrorInvalidValue;
    if (prop->location.type != hipMemLocationTypeDevice)
        return prop->location.type == hipMemLocationTypeHost ? hipErrorNotSupported
                                                             : hipErrorInvalidValue;
    if (check_device(prop->location.id) != hipSuccess)
        return hipErrorInvalidDevice;
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipMemGetAllocationGranularity(size_t *out,
                                                            const hipMemAllocationProp *prop,
                                                            int option)
{
    if (out == NULL)
        return hipErrorInvalidValue;
    if (option != hipMemAllocationGranularityMinimum &&
        option != hipMemAllocationGranularityRecommended)
        return hipErrorInvalidValue;
    hipError_t status = check_prop(prop);
    if (status == hipErrorInvalidDevice)
        status = hipErrorInvalidValue; /* HIP reports a bad location id as a bad value here */
    if (status == hipSuccess)
        *out = granularity();
    return status;
}

/* Whether [base, base + size) overlaps a reservation. Under g_lock. */
static int overlaps_reservation(uintptr_t base, size_t size)
{
    for (const struct reservation *r = g_reservations; r != NULL; r = r->next)
        if (base < r->base + r->size && r->base < base + size)
            return 1;
    return 0;
}

/* Whether this request for a particular address is to be given another one (the
 * switches), counting the miss. Under g_lock. */
static int miss_requested_address(void)
{
    if (env_flag("HIPSTANDIN_IGNORE_ADDRESS"))
        return 1;
    if (g_address_misses_left > 0) {
        g_address_misses_left--;
        return 1;
    }
    return 0;
}

HIPSTANDIN_EXPORT hipError_t hipMemAddressReserve(void **ptr, size_t size, size_t alignment,
                                                  void *addr, unsigned long long flags)
{
    size_t g = granularity();
    if (ptr == NULL || flags != 0 || size == 0 || size % g != 0 ||
        (alignment & (alignment - 1)) != 0)
        return hipErrorInvalidValue;
    size_t align = alignment > g ? alignment : g;
    struct reservation *r = calloc(1, sizeof *r);
    if (r == NULL)
        return hipErrorOutOfMemory;
    const int prot = PROT_NONE;
    const int kind = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    void *base = MAP_FAILED;
    /* Held from the look at the requested range until the new reservation is listed, so
     * two threads cannot both be granted one range. */
    pthread_mutex_lock(&g_lock);
    /* A requested address is granted when that range is free (of reservations and of
     * anything else the process mapped there); otherwise, as in ROCr, the reservation is
     * made elsewhere and the call still succeeds. */
    void *placeholder = MAP_FAILED;
    if (addr != NULL) {
        int granted = 0;
        if ((uintptr_t)addr % align == 0 && !overlaps_reservation((uintptr_t)addr, size)) {
            base = mmap(addr, size, prot, kind | MAP_FIXED_NOREPLACE, -1, 0);
            if (base != MAP_FAILED && base != addr) {
                munmap(base, size); /* an old kernel took the flag as a plain hint */
                base = MAP_FAILED;
            }
            if (base != MAP_FAILED && miss_requested_address()) {
                /* refused by a switch although free: keep it occupied while the
                 * reservation is placed, so that it cannot land there by chance */
                placeholder = base;
                base = MAP_FAILED;
            }
            granted = base != MAP_FAILED;
        }
        if (!granted)
            g_stats.address_misses++;
    }
    if (base == MAP_FAILED) {
        void *raw = mmap(NULL, size + align, prot, kind, -1, 0);
        if (raw == MAP_FAILED) {
            if (placeholder != MAP_FAILED)
                munmap(placeholder, size);
            pthread_mutex_unlock(&g_lock);
            free(r);
            return hipErrorOutOfMemory;
        }
        uintptr_t start = ((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1);
        if (start > (uintptr_t)raw)
            munmap(raw, start - (uintptr_t)raw);
        uintptr_t tail = (uintptr_t)raw + size + align - (start + size);
        if (tail > 0)
            munmap((void *)(start + size), tail);
        base = (void *)start;
    }
    if (placeholder != MAP_FAILED)
        munmap(placeholder, size);
    r->base = (uintptr_t)base;
    r->size = size;
    r->next = g_reservations;
    g_reservations = r;
    g_stats.reservations++;
    g_stats.address_reserve_calls++;
    pthread_mutex_unlock(&g_lock);
    *ptr = base;
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipMemAddressFree(void *ptr, size_t size)
{
    if (ptr == NULL || size == 0)
        return hipErrorInvalidValue;
    pthread_mutex_lock(&g_lock);
    g_stats.address_free_calls++;
    struct reservation **link = &g_reservations;
    while (*link != NULL && (*link)->base != (uintptr_t)ptr)
        link = &(*link)->next;
    struct reservation *r = *link;
    hipError_t status = hipSuccess;
    if (r == NULL || r->size != size)
        status = hipErrorInvalidValue;
    else if (r->use_count > 0 || r->mappings != NULL)
        status = hipErrorUnknown; /* ROCr refuses to free a range that is still in use */
    if (status != hipSuccess) {
        pthread_mutex_unlock(&g_lock);
        return status;
    }
    *link = r->next;
    munmap(ptr, size); /* with it go the stale mappings the release bug left there */
    g_stats.reservations--;
    replace_range(r->base, r->size);
    free(r);
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipMemCreate(hipMemGenericAllocationHandle_t *handle, size_t size,
                                          const hipMemAllocationProp *prop,
                                          unsigned long long flags)
{
    if (handle == NULL || size == 0 || flags != 0)
        return hipErrorInvalidValue;
    hipError_t status = check_prop(prop);
    if (status != hipSuccess)
        return status;
    if (prop->requestedHandleTypes != hipMemHandleTypeNone)
        return hipErrorNotSupported;
    if (size % granularity() != 0)
        return hipErrorInvalidValue;
    struct hipstandin_allocation *a = calloc(1, sizeof *a);
    if (a == NULL)
        return hipErrorOutOfMemory;
    pthread_mutex_lock(&g_lock);
    status = acct_charge(prop->location.id, size);
    if (status == hipSuccess) {
        a->offset = arena_take(size);
        if (a->offset < 0) {
            acct_uncharge(prop->location.id, size);
            status = hipErrorOutOfMemory;
        }
    }
    if (status != hipSuccess) {
        pthread_mutex_unlock(&g_lock);
        free(a);
        return status;
    }
    a->magic = ALLOC_MAGIC;
    a->device = prop->location.id;
    a->size = size;
    a->next = g_allocs;
    g_allocs = a;
    g_stats.allocations++;
    g_stats.process_bytes += size;
    pthread_mutex_unlock(&g_lock);
    *handle = a;
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle)
{
    if (handle == NULL)
        return hipErrorInvalidValue;
    pthread_mutex_lock(&g_lock);
    struct hipstandin_allocation *a = find_alloc(handle);
    if (a == NULL) {
        pthread_mutex_unlock(&g_lock);
        return hipErrorInvalidValue;
    }
    /* Like HIP, a mapped allocation is freed when its last mapping goes. */
    a->released = 1;
    maybe_destroy(a);
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipMemMap(void *ptr, size_t size, size_t offset,
                                       hipMemGenericAllocationHandle_t handle,
                                       unsigned long long flags)
{
    if (ptr == NULL || handle == NULL || size == 0 || offset != 0 || flags != 0 ||
        size % granularity() != 0)
        return hipErrorInvalidValue;
    uintptr_t va = (uintptr_t)ptr;
    pthread_mutex_lock(&g_lock);
    struct hipstandin_allocation *a = find_alloc(handle);
    struct reservation *r = find_reservation(va, size);
    hipError_t status = hipSuccess;
    if (a == NULL || r == NULL || size != a->size)
        status = hipErrorInvalidValue;
    struct mapping **link = r != NULL ? &r->mappings : NULL;
    if (status == hipSuccess) {
        while (*link != NULL && (*link)->va + (*link)->size <= va)
            link = &(*link)->next;
        if (*link != NULL && (*link)->va < va + size)
            status = hipErrorInvalidValue; /* already mapped */
    }
    struct mapping *m = NULL;
    if (status == hipSuccess && (m = calloc(1, sizeof *m)) == NULL)
        status = hipErrorOutOfMemory;
    if (status == hipSuccess &&
        mmap(ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, g_arena_fd, a->offset) == MAP_FAILED) {
        free(m);
        status = hipErrorOutOfMemory;
    }
    if (status != hipSuccess) {
        pthread_mutex_unlock(&g_lock);
        return status;
    }
    *m = (struct mapping){va, size, a, hipMemAccessFlagsProtNone, *link};
    *link = m;
    a->mappings++;
    r->use_count++;
    g_stats.mappings++;
    replace_range(va, size); /* the new mapping replaced any stale one there */
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipMemUnmap(void *ptr, size_t size)
{
    if (ptr == NULL || size == 0)
        return hipErrorInvalidValue;
    uintptr_t va = (uintptr_t)ptr;
    pthread_mutex_lock(&g_lock);
    g_stats.unmap_calls++;
    struct reservation *r = find_reservation(va, size);
    int count = 0;
    struct mapping *first = r != NULL ? covering(r, va, size, &count) : NULL;
    if (first == NULL) {
        pthread_mutex_unlock(&g_lock);
        return hipErrorInvalidValue;
    }
    /* The range goes back to reserved-but-unbacked address space; under the release
     * bug, the allocations stay mapped there with no access, as ROCr leaves them. */
    int bug = env_flag("HIPSTANDIN_BUG_RELEASE");
    if (bug)
        mprotect(ptr, size, PROT_NONE);
    else
        mmap(ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
             0);
    struct mapping **link = &r->mappings;
    while (*link != first)
        link = &(*link)->next;
    for (int i = 0; i < count; i++) {
        struct mapping *m = *link;
        *link = m->next;
        m->alloc->mappings--;
        if (bug)
            add_stale(m->alloc, m->va, m->size);
        maybe_destroy(m->alloc);
        free(m);
        g_stats.mappings--;
    }
    if (count > 1) {
        g_stats.multi_unmap_calls++;
        /* ROCR-Runtime#285: the range keeps count - 1 phantom users. */
        r->use_count -= env_flag("HIPSTANDIN_BUG_MULTI_UNMAP") ? 1 : count;
    } else {
        r->use_count -= 1;
    }
    pthread_mutex_unlock(&g_lock);
    return hipSuccess;
}

/* Whether the buggy coverage checks of some ROCm releases reject this set-access. */
static int setaccess_rejected(const struct reservation *r, const struct mapping *first,
                              int count, size_t size)
{
    switch (setaccess_bug()) {
    case SETACCESS_TAIL:
        return first != r->mappings && count > 1;
    case SETACCESS_PREFIX: {
        size_t sum = 0;
        for (const struct mapping *m = r->mappings; m != NULL && sum < size; m = m->next)
            sum += m->size;
        return sum != size;
    }
    default:
        return 0;
    }
}

HIPSTANDIN_EXPORT hipError_t hipMemSetAccess(void *ptr, size_t size, const hipMemAccessDesc *desc,
                                             size_t count)
{
    if (ptr == NULL || size == 0 || desc == NULL || count == 0)
        return hipErrorInvalidValue;
    int access = hipMemAccessFlagsProtNone;
    for (size_t i = 0; i < count; i++) {
        const hipMemAccessDesc *d = &desc[i];
        if (d->location.type != hipMemLocationTypeDevice &&
            d->location.type != hipMemLocationTypeHost)
            return hipErrorInvalidValue;
        if (d->location.type == hipMemLocationTypeDevice &&
            check_device(d->location.id) != hipSuccess)
            return hipErrorInvalidValue;
        if (d->flags != hipMemAccessFlagsProtNone && d->flags != hipMemAccessFlagsProtRead &&
            d->flags != hipMemAccessFlagsProtReadWrite)
            return hipErrorInvalidValue;
        access |= d->flags;
    }
    uintptr_t va = (uintptr_t)ptr;
    pthread_mutex_lock(&g_lock);
    g_stats.setaccess_calls++;
    struct reservation *r = find_reservation(va, size);
    int n = 0;
    struct mapping *first = r != NULL ? covering(r, va, size, &n) : NULL;
    hipError_t status = first == NULL ? hipErrorInvalidValue : hipSuccess;
    if (status == hipSuccess && setaccess_rejected(r, first, n, size)) {
        g_stats.setaccess_rejected_by_bug++;
        status = hipErrorInvalidValue;
    }
    if (status == hipSuccess) {
        int prot = access == hipMemAccessFlagsProtReadWrite ? PROT_READ | PROT_WRITE
                   : access == hipMemAccessFlagsProtRead    ? PROT_READ
                                                            : PROT_NONE;
        struct mapping *m = first;
        for (int i = 0; i < n; i++, m = m->next) {
            mprotect((void *)m->va, m->size, prot);
            m->access = access;
        }
    }
    pthread_mutex_unlock(&g_lock);
    return status;
}

HIPSTANDIN_EXPORT hipError_t hipMemGetAccess(unsigned long long *flags,
                                             const hipMemLocation *location, void *ptr)
{
    if (flags == NULL || location == NULL || ptr == NULL ||
        location->type != hipMemLocationTypeDevice || check_device(location->id) != hipSuccess)
        return hipErrorInvalidValue;
    uintptr_t va = (uintptr_t)ptr;
    pthread_mutex_lock(&g_lock);
    struct reservation *r = find_reservation(va, 1);
    hipError_t status = hipErrorInvalidValue;
    for (struct mapping *m = r != NULL ? r->mappings : NULL; m != NULL; m = m->next)
        if (va >= m->va && va - m->va < m->size) {
            *flags = (unsigned long long)m->access;
            status = hipSuccess;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    return status;
}

/* ================================================================== test hooks (not HIP) */

HIPSTANDIN_EXPORT size_t hipstandin_stats(struct hipstandin_stats *out, size_t size)
{
    pthread_mutex_lock(&g_lock);
    struct hipstandin_stats now = g_stats;
    now.held_bytes = 0;
    for (struct hipstandin_allocation *a = g_allocs; a != NULL; a = a->next)
        if (a->released)
            now.held_bytes += a->size;
    pthread_mutex_unlock(&g_lock);
    if (out != NULL)
        memcpy(out, &now, size < sizeof now ? size : sizeof now);
    return sizeof now;
}

/* The next `n` hipMemAddressReserve calls that would be granted the address they ask
 * for get another one (what another thread taking the range at that moment does). */
HIPSTANDIN_EXPORT void hipstandin_miss_requested_addresses(unsigned long n)
{
    pthread_mutex_lock(&g_lock);
    g_address_misses_left = n;
    pthread_mutex_unlock(&g_lock);
}

HIPSTANDIN_EXPORT const char *hipstandin_variant(void)
{
    return "host";
}
