/*
 * libamdhip64.so stand-in that forwards HIP's virtual memory management (VMM) calls to
 * the CUDA driver, so kvcached's ROCm backend runs its real hip-python code path, and
 * really maps device memory, on an NVIDIA GPU. It is the on-GPU counterpart of the host
 * stand-in: what it proves is that the backend's calls, structures and error handling
 * work against a driver that enforces them, with torch views of real device memory.
 *
 * HIP's VMM API is a copy of CUDA's: the structures have the same layout and the enum
 * values are the same (hipMemLocationTypeDevice == CU_MEM_LOCATION_TYPE_DEVICE, ...), so
 * forwarding is mostly a cast. The differences handled here:
 *   - HIP tracks a current device per thread (hipSetDevice); CUDA needs a current
 *     context. Each forwarded call first makes the primary context of the thread's
 *     current device current, which is what the HIP runtime does on NVIDIA too.
 *   - hipMemGenericAllocationHandle_t is a pointer, CUmemGenericAllocationHandle a
 *     64-bit integer: the integer travels in the pointer.
 *   - CUresult codes become hipError_t codes; the ones HIP shares keep their number.
 *   - device attributes are renumbered (HIP and CUDA number them differently).
 *
 * The CUDA driver is opened with dlopen at the first call, so this library builds and
 * loads on machines without CUDA: there, every call answers hipErrorNoDevice. No CUDA
 * header is needed; the few driver prototypes used are declared below.
 */
#define _GNU_SOURCE
#include "hipstandin.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* ------------------------------------------------------------------ CUDA driver API */

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUctx_st *CUcontext;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

enum {
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16,
    CU_DEVICE_ATTRIBUTE_INTEGRATED = 18,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75,
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
};

typedef struct {
    int type;
    int id;
} CUmemLocation;

typedef struct {
    int type;
    int requestedHandleTypes;
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags;
} CUmemAccessDesc;

#define MAX_DEVICES 64
#define MAX_ACCESS_DESCS 64

static struct {
    CUresult (*init)(unsigned int);
    CUresult (*driver_version)(int *);
    CUresult (*device_count)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_attribute)(int *, int, CUdevice);
    CUresult (*device_name)(char *, int, CUdevice);
    CUresult (*device_total_mem)(size_t *, CUdevice);
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*ctx_synchronize)(void);
    CUresult (*mem_get_info)(size_t *, size_t *);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*address_free)(CUdeviceptr, size_t);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                       unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                    unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*get_access)(unsigned long long *, const CUmemLocation *, CUdeviceptr);
} cu;

static pthread_once_t g_load_once = PTHREAD_ONCE_INIT;
static int g_loaded;     /* libcuda.so.1 opened, every symbol found and cuInit succeeded */
static pthread_mutex_t g_ctx_lock = PTHREAD_MUTEX_INITIALIZER;
static CUcontext g_primary[MAX_DEVICES]; /* retained once per device, never released */
static __thread int t_device = 0;
static __thread CUcontext t_current;

static void load_driver(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return;
    struct {
        void **slot;
        const char *name;
    } symbols[] = {
        {(void **)&cu.init, "cuInit"},
        {(void **)&cu.driver_version, "cuDriverGetVersion"},
        {(void **)&cu.device_count, "cuDeviceGetCount"},
        {(void **)&cu.device_get, "cuDeviceGet"},
        {(void **)&cu.device_attribute, "cuDeviceGetAttribute"},
        {(void **)&cu.device_name, "cuDeviceGetName"},
        {(void **)&cu.device_total_mem, "cuDeviceTotalMem_v2"},
        {(void **)&cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu.ctx_set_current, "cuCtxSetCurrent"},
        {(void **)&cu.ctx_synchronize, "cuCtxSynchronize"},
        {(void **)&cu.mem_get_info, "cuMemGetInfo_v2"},
        {(void **)&cu.granularity, "cuMemGetAllocationGranularity"},
        {(void **)&cu.address_reserve, "cuMemAddressReserve"},
        {(void **)&cu.address_free, "cuMemAddressFree"},
        {(void **)&cu.create, "cuMemCreate"},
        {(void **)&cu.release, "cuMemRelease"},
        {(void **)&cu.map, "cuMemMap"},
        {(void **)&cu.unmap, "cuMemUnmap"},
        {(void **)&cu.set_access, "cuMemSetAccess"},
        {(void **)&cu.get_access, "cuMemGetAccess"},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        *symbols[i].slot = dlsym(lib, symbols[i].name);
        if (*symbols[i].slot == NULL)
            return;
    }
    g_loaded = cu.init(0) == CUDA_SUCCESS;
}

static int driver_ready(void)
{
    pthread_once(&g_load_once, load_driver);
    return g_loaded;
}

static hipError_t from_cu(CUresult result)
{
    switch (result) {
    case CUDA_SUCCESS: return hipSuccess;
    case CUDA_ERROR_INVALID_VALUE: return hipErrorInvalidValue;
    case CUDA_ERROR_OUT_OF_MEMORY: return hipErrorOutOfMemory;
    case CUDA_ERROR_NOT_INITIALIZED: return hipErrorNotInitialized;
    case CUDA_ERROR_NO_DEVICE: return hipErrorNoDevice;
    case CUDA_ERROR_INVALID_DEVICE: return hipErrorInvalidDevice;
    case CUDA_ERROR_INVALID_CONTEXT: return hipErrorInvalidContext;
    case CUDA_ERROR_NOT_SUPPORTED: return hipErrorNotSupported;
    default: return hipErrorUnknown;
    }
}

static hipError_t check_device(int device)
{
    int count = 0;
    if (!driver_ready() || cu.device_count(&count) != CUDA_SUCCESS || count == 0)
        return hipErrorNoDevice;
    return device >= 0 && device < count && device < MAX_DEVICES ? hipSuccess
                                                                  : hipErrorInvalidDevice;
}

/* Make the primary context of this thread's current device current, as HIP would. */
static hipError_t use_current_device(void)
{
    hipError_t status = check_device(t_device);
    if (status != hipSuccess)
        return status;
    pthread_mutex_lock(&g_ctx_lock);
    if (g_primary[t_device] == NULL) {
        CUdevice device;
        CUresult r = cu.device_get(&device, t_device);
        if (r == CUDA_SUCCESS)
            r = cu.primary_ctx_retain(&g_primary[t_device], device);
        if (r != CUDA_SUCCESS) {
            pthread_mutex_unlock(&g_ctx_lock);
            return from_cu(r);
        }
    }
    CUcontext ctx = g_primary[t_device];
    pthread_mutex_unlock(&g_ctx_lock);
    if (t_current != ctx) {
        CUresult r = cu.ctx_set_current(ctx);
        if (r != CUDA_SUCCESS)
            return from_cu(r);
        t_current = ctx;
    }
    return hipSuccess;
}

static hipError_t to_cu_prop(const hipMemAllocationProp *in, CUmemAllocationProp *out)
{
    if (in == NULL)
        return hipErrorInvalidValue;
    memset(out, 0, sizeof *out);
    out->type = in->type;
    out->requestedHandleTypes = in->requestedHandleTypes;
    out->location.type = in->location.type;
    out->location.id = in->location.id;
    out->allocFlags.compressionType = in->allocFlags.compressionType;
    out->allocFlags.gpuDirectRDMACapable = in->allocFlags.gpuDirectRDMACapable;
    out->allocFlags.usage = in->allocFlags.usage;
    return hipSuccess;
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
    return driver_ready() ? hipSuccess : hipErrorNoDevice;
}

HIPSTANDIN_EXPORT hipError_t hipDriverGetVersion(int *version)
{
    if (version == NULL)
        return hipErrorInvalidValue;
    if (!driver_ready())
        return hipErrorNoDevice;
    int cuda = 0;
    CUresult r = cu.driver_version(&cuda);
    /* CUDA writes 1000 * major + 10 * minor; HIP 10**7 * major + 10**5 * minor + patch.
     * Reported in HIP's encoding, so the CUDA driver's version reads as "13.0.0". */
    if (r == CUDA_SUCCESS)
        *version = cuda / 1000 * 10000000 + cuda % 1000 / 10 * 100000;
    return from_cu(r);
}

HIPSTANDIN_EXPORT hipError_t hipRuntimeGetVersion(int *version)
{
    return hipDriverGetVersion(version);
}

HIPSTANDIN_EXPORT hipError_t hipGetDeviceCount(int *count)
{
    if (count == NULL)
        return hipErrorInvalidValue;
    *count = 0;
    if (!driver_ready())
        return hipErrorNoDevice;
    CUresult r = cu.device_count(count);
    if (r != CUDA_SUCCESS)
        return from_cu(r);
    return *count > 0 ? hipSuccess : hipErrorNoDevice;
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
    if (!driver_ready())
        return hipErrorNoDevice;
    *device = t_device;
    return hipSuccess;
}

HIPSTANDIN_EXPORT hipError_t hipDeviceSynchronize(void)
{
    hipError_t status = use_current_device();
    return status == hipSuccess ? from_cu(cu.ctx_synchronize()) : status;
}

HIPSTANDIN_EXPORT hipError_t hipDeviceGetAttribute(int *value, int attribute, int device)
{
    if (value == NULL)
        return hipErrorInvalidValue;
    hipError_t status = check_device(device);
    if (status != hipSuccess)
        return status;
    int cu_attribute;
    switch (attribute) {
    case HIPSTANDIN_ATTR_VMM:
        cu_attribute = CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED;
        break;
    case HIPSTANDIN_ATTR_INTEGRATED:
        cu_attribute = CU_DEVICE_ATTRIBUTE_INTEGRATED;
        break;
    case HIPSTANDIN_ATTR_CC_MAJOR:
        cu_attribute = CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR;
        break;
    case HIPSTANDIN_ATTR_CC_MINOR:
        cu_attribute = CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR;
        break;
    case HIPSTANDIN_ATTR_SM_COUNT:
        cu_attribute = CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        break;
    default:
        return hipErrorInvalidValue;
    }
    CUdevice cu_device;
    CUresult r = cu.device_get(&cu_device, device);
    if (r == CUDA_SUCCESS)
        r = cu.device_attribute(value, cu_attribute, cu_device);
    return from_cu(r);
}

HIPSTANDIN_EXPORT hipError_t hipDeviceGetName(char *name, int len, hipDevice_t device)
{
    if (name == NULL || len <= 0)
        return hipErrorInvalidValue;
    hipError_t status = check_device(device);
    if (status != hipSuccess)
        return status;
    CUdevice cu_device;
    char cu_name[256] = "";
    CUresult r = cu.device_get(&cu_device, device);
    if (r == CUDA_SUCCESS)
        r = cu.device_name(cu_name, (int)sizeof cu_name, cu_device);
    if (r == CUDA_SUCCESS)
        snprintf(name, (size_t)len, "%s via the kvcached HIP stand-in (CUDA)", cu_name);
    return from_cu(r);
}

HIPSTANDIN_EXPORT hipError_t hipDeviceTotalMem(size_t *bytes, hipDevice_t device)
{
    if (bytes == NULL)
        return hipErrorInvalidValue;
    hipError_t status = check_device(device);
    if (status != hipSuccess)
        return status;
    CUdevice cu_device;
    CUresult r = cu.device_get(&cu_device, device);
    if (r == CUDA_SUCCESS)
        r = cu.device_total_mem(bytes, cu_device);
    return from_cu(r);
}

HIPSTANDIN_EXPORT hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    if (free_bytes == NULL || total_bytes == NULL)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    return status == hipSuccess ? from_cu(cu.mem_get_info(free_bytes, total_bytes)) : status;
}

HIPSTANDIN_EXPORT hipError_t hipMemGetAllocationGranularity(size_t *out,
                                                            const hipMemAllocationProp *prop,
                                                            int option)
{
    CUmemAllocationProp cu_prop;
    if (out == NULL || to_cu_prop(prop, &cu_prop) != hipSuccess)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    return status == hipSuccess ? from_cu(cu.granularity(out, &cu_prop, option)) : status;
}

HIPSTANDIN_EXPORT hipError_t hipMemAddressReserve(void **ptr, size_t size, size_t alignment,
                                                  void *addr, unsigned long long flags)
{
    if (ptr == NULL)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    if (status != hipSuccess)
        return status;
    /* The requested address travels to cuMemAddressReserve's `addr`. CUDA takes it as a
     * hint, as ROCr does: when the range is taken the reservation lands elsewhere and the
     * call still succeeds, so the caller compares what it got. */
    CUdeviceptr base = 0;
    CUresult r = cu.address_reserve(&base, size, alignment, (CUdeviceptr)(uintptr_t)addr, flags);
    if (r == CUDA_SUCCESS)
        *ptr = (void *)(uintptr_t)base;
    return from_cu(r);
}

HIPSTANDIN_EXPORT hipError_t hipMemAddressFree(void *ptr, size_t size)
{
    hipError_t status = use_current_device();
    return status == hipSuccess ? from_cu(cu.address_free((CUdeviceptr)(uintptr_t)ptr, size))
                                : status;
}

HIPSTANDIN_EXPORT hipError_t hipMemCreate(hipMemGenericAllocationHandle_t *handle, size_t size,
                                          const hipMemAllocationProp *prop,
                                          unsigned long long flags)
{
    CUmemAllocationProp cu_prop;
    if (handle == NULL || to_cu_prop(prop, &cu_prop) != hipSuccess)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    if (status != hipSuccess)
        return status;
    CUmemGenericAllocationHandle cu_handle = 0;
    CUresult r = cu.create(&cu_handle, size, &cu_prop, flags);
    if (r == CUDA_SUCCESS)
        *handle = (hipMemGenericAllocationHandle_t)(uintptr_t)cu_handle;
    return from_cu(r);
}

HIPSTANDIN_EXPORT hipError_t hipMemRelease(hipMemGenericAllocationHandle_t handle)
{
    if (handle == NULL)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    return status == hipSuccess
               ? from_cu(cu.release((CUmemGenericAllocationHandle)(uintptr_t)handle))
               : status;
}

HIPSTANDIN_EXPORT hipError_t hipMemMap(void *ptr, size_t size, size_t offset,
                                       hipMemGenericAllocationHandle_t handle,
                                       unsigned long long flags)
{
    if (ptr == NULL || handle == NULL)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    return status == hipSuccess
               ? from_cu(cu.map((CUdeviceptr)(uintptr_t)ptr, size, offset,
                                (CUmemGenericAllocationHandle)(uintptr_t)handle, flags))
               : status;
}

HIPSTANDIN_EXPORT hipError_t hipMemUnmap(void *ptr, size_t size)
{
    if (ptr == NULL)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    return status == hipSuccess ? from_cu(cu.unmap((CUdeviceptr)(uintptr_t)ptr, size)) : status;
}

HIPSTANDIN_EXPORT hipError_t hipMemSetAccess(void *ptr, size_t size, const hipMemAccessDesc *desc,
                                             size_t count)
{
    if (ptr == NULL || desc == NULL || count == 0 || count > MAX_ACCESS_DESCS)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    if (status != hipSuccess)
        return status;
    CUmemAccessDesc cu_desc[MAX_ACCESS_DESCS];
    for (size_t i = 0; i < count; i++) {
        cu_desc[i].location.type = desc[i].location.type;
        cu_desc[i].location.id = desc[i].location.id;
        cu_desc[i].flags = desc[i].flags;
    }
    return from_cu(cu.set_access((CUdeviceptr)(uintptr_t)ptr, size, cu_desc, count));
}

HIPSTANDIN_EXPORT hipError_t hipMemGetAccess(unsigned long long *flags,
                                             const hipMemLocation *location, void *ptr)
{
    if (flags == NULL || location == NULL)
        return hipErrorInvalidValue;
    hipError_t status = use_current_device();
    if (status != hipSuccess)
        return status;
    CUmemLocation cu_location = {location->type, location->id};
    return from_cu(cu.get_access(flags, &cu_location, (CUdeviceptr)(uintptr_t)ptr));
}

/* ================================================================== test hooks (not HIP) */

HIPSTANDIN_EXPORT const char *hipstandin_variant(void)
{
    return "cuda";
}
