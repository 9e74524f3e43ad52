/*
 * The slice of the HIP runtime API that kvcached's ROCm backend calls through
 * hip-python, declared here so the stand-in libraries build with nothing but a C
 * compiler: no ROCm and no CUDA headers.
 *
 * Layouts and values follow ROCm's hip_runtime_api.h (and hence CUDA's, which HIP
 * mirrors): hipMemAllocationProp is 32 bytes with `location` at offset 8, the
 * hipError_t codes are the ones hip-python's `hipError_t` enum carries. Device
 * attribute numbers are the one thing that has moved between HIP releases, so the
 * build helper passes the values of the installed hip-python as -D flags; the
 * defaults below are those of hip-python 10.x (HIP 7.x headers).
 */
#ifndef KVCACHED_HIPSTANDIN_H
#define KVCACHED_HIPSTANDIN_H

#include <stddef.h>

#define HIPSTANDIN_EXPORT __attribute__((visibility("default")))

typedef int hipError_t;
enum {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorOutOfMemory = 2,
    hipErrorNotInitialized = 3,
    hipErrorNoDevice = 100,
    hipErrorInvalidDevice = 101,
    hipErrorInvalidContext = 201,
    hipErrorNotSupported = 801,
    hipErrorUnknown = 999,
};

typedef int hipDevice_t;

typedef enum {
    hipMemLocationTypeInvalid = 0,
    hipMemLocationTypeDevice = 1,
    hipMemLocationTypeHost = 2,
} hipMemLocationType;

typedef enum {
    hipMemAllocationTypeInvalid = 0,
    hipMemAllocationTypePinned = 1,
} hipMemAllocationType;

typedef enum {
    hipMemHandleTypeNone = 0,
} hipMemAllocationHandleType;

typedef enum {
    hipMemAccessFlagsProtNone = 0,
    hipMemAccessFlagsProtRead = 1,
    hipMemAccessFlagsProtReadWrite = 3,
} hipMemAccessFlags;

typedef enum {
    hipMemAllocationGranularityMinimum = 0,
    hipMemAllocationGranularityRecommended = 1,
} hipMemAllocationGranularity_flags;

typedef struct {
    int type; /* hipMemLocationType */
    int id;
} hipMemLocation;

typedef struct {
    int type; /* hipMemAllocationType */
    int requestedHandleTypes; /* a union with requestedHandleType in HIP */
    hipMemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
    } allocFlags;
} hipMemAllocationProp;

typedef struct {
    hipMemLocation location;
    int flags; /* hipMemAccessFlags */
} hipMemAccessDesc;

/* An opaque pointer in HIP; each stand-in decides what it points at. */
typedef struct hipstandin_allocation *hipMemGenericAllocationHandle_t;

/* hipDeviceAttribute_t values the stand-ins answer (see the header comment). */
#ifndef HIPSTANDIN_ATTR_VMM
#define HIPSTANDIN_ATTR_VMM 89 /* hipDeviceAttributeVirtualMemoryManagementSupported */
#endif
#ifndef HIPSTANDIN_ATTR_INTEGRATED
#define HIPSTANDIN_ATTR_INTEGRATED 16 /* hipDeviceAttributeIntegrated */
#endif
#ifndef HIPSTANDIN_ATTR_CC_MAJOR
#define HIPSTANDIN_ATTR_CC_MAJOR 23 /* hipDeviceAttributeComputeCapabilityMajor */
#endif
#ifndef HIPSTANDIN_ATTR_CC_MINOR
#define HIPSTANDIN_ATTR_CC_MINOR 61 /* hipDeviceAttributeComputeCapabilityMinor */
#endif
#ifndef HIPSTANDIN_ATTR_SM_COUNT
#define HIPSTANDIN_ATTR_SM_COUNT 63 /* hipDeviceAttributeMultiprocessorCount */
#endif

/* Names for hipGetErrorName / hipGetErrorString, shared by both stand-ins. */
static inline const char *hipstandin_error_name(hipError_t error)
{
    switch (error) {
    case hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case hipErrorNotInitialized: return "hipErrorNotInitialized";
    case hipErrorNoDevice: return "hipErrorNoDevice";
    case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
    case hipErrorInvalidContext: return "hipErrorInvalidContext";
    case hipErrorNotSupported: return "hipErrorNotSupported";
    case hipErrorUnknown: return "hipErrorUnknown";
    default: return "hipErrorUnknown";
    }
}

static inline const char *hipstandin_error_string(hipError_t error)
{
    switch (error) {
    case hipSuccess: return "no error";
    case hipErrorInvalidValue: return "invalid argument";
    case hipErrorOutOfMemory: return "out of memory";
    case hipErrorNotInitialized: return "initialization error";
    case hipErrorNoDevice: return "no ROCm-capable device is detected";
    case hipErrorInvalidDevice: return "invalid device ordinal";
    case hipErrorInvalidContext: return "invalid device context";
    case hipErrorNotSupported: return "operation not supported";
    default: return "unknown error";
    }
}

#endif /* KVCACHED_HIPSTANDIN_H */
