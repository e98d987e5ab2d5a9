/* A Vulkan ICD that is Mesa's lavapipe under SwiftShader's ids, for a real float16 WebGPU adapter in Chromium
 * without a GPU (scripts/install-browser-webgpu builds it; the measured facts: /work/shared/design/webgpu.md).
 *
 * Chromium takes a Vulkan adapter only if it has external semaphores (lavapipe lacks VK_KHR_external_semaphore_fd)
 * or reports SwiftShader's vendor and device ids; SwiftShader itself has no shaderFloat16. This ICD forwards every
 * call to lavapipe's ICD (libvulkan_lvp.so, found on LD_LIBRARY_PATH) and changes one thing: vendorID and deviceID
 * in the physical device's properties read 0x1AE0 / 0xC0DE. Everything else, shader-f16 included, is lavapipe.
 * No Vulkan headers are needed: only the leading fields of VkPhysicalDeviceProperties(2) are touched. */
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef void (*PFN_vkVoidFunction)(void);
typedef int32_t VkResult;
typedef PFN_vkVoidFunction (*PFN_gipa)(void *instance, const char *name);
typedef VkResult (*PFN_negotiate)(uint32_t *version);
typedef void (*PFN_props)(void *physical_device, void *properties);

#define SWIFTSHADER_VENDOR 0x1AE0u
#define SWIFTSHADER_DEVICE 0xC0DEu
#define VK_ERROR_INCOMPATIBLE_DRIVER (-9)

/* VkPhysicalDeviceProperties: apiVersion, driverVersion, vendorID, deviceID, ... (uint32_t each) */
struct props_head { uint32_t api_version, driver_version, vendor_id, device_id; };
/* VkPhysicalDeviceProperties2: sType, pNext, then VkPhysicalDeviceProperties */
struct props2_head { int32_t s_type; void *p_next; struct props_head properties; };

static void *lvp;
static PFN_gipa lvp_gipa, lvp_gpdpa;
static PFN_props real_props, real_props2, real_props2_khr;

static int load(void) {
    if (lvp) return 1;
    lvp = dlopen("libvulkan_lvp.so", RTLD_NOW | RTLD_LOCAL);
    if (!lvp) return 0;
    lvp_gipa = (PFN_gipa)dlsym(lvp, "vk_icdGetInstanceProcAddr");
    lvp_gpdpa = (PFN_gipa)dlsym(lvp, "vk_icdGetPhysicalDeviceProcAddr");
    return lvp_gipa != 0;
}

static void rewrite(struct props_head *p) {
    p->vendor_id = SWIFTSHADER_VENDOR;
    p->device_id = SWIFTSHADER_DEVICE;
}

static void props(void *pd, void *out) { real_props(pd, out); rewrite(out); }
static void props2(void *pd, void *out) { real_props2(pd, out); rewrite(&((struct props2_head *)out)->properties); }
static void props2_khr(void *pd, void *out) { real_props2_khr(pd, out); rewrite(&((struct props2_head *)out)->properties); }

__attribute__((visibility("default"))) PFN_vkVoidFunction vk_icdGetInstanceProcAddr(void *instance, const char *name);

/* lavapipe's function for `name`, or ours where we change what it answers (kept: `real` is what ours calls) */
static PFN_vkVoidFunction wrap(const char *name, PFN_vkVoidFunction found) {
    if (!found) return 0;
    if (!strcmp(name, "vkGetPhysicalDeviceProperties")) { real_props = (PFN_props)found; return (PFN_vkVoidFunction)props; }
    if (!strcmp(name, "vkGetPhysicalDeviceProperties2")) { real_props2 = (PFN_props)found; return (PFN_vkVoidFunction)props2; }
    if (!strcmp(name, "vkGetPhysicalDeviceProperties2KHR")) { real_props2_khr = (PFN_props)found; return (PFN_vkVoidFunction)props2_khr; }
    /* whoever asks lavapipe's own lookup for a lookup function would bypass this file */
    if (!strcmp(name, "vkGetInstanceProcAddr")) return (PFN_vkVoidFunction)vk_icdGetInstanceProcAddr;
    return found;
}

__attribute__((visibility("default"))) VkResult vk_icdNegotiateLoaderICDInterfaceVersion(uint32_t *version) {
    if (!load()) return VK_ERROR_INCOMPATIBLE_DRIVER;
    PFN_negotiate negotiate = (PFN_negotiate)dlsym(lvp, "vk_icdNegotiateLoaderICDInterfaceVersion");
    return negotiate ? negotiate(version) : VK_ERROR_INCOMPATIBLE_DRIVER;
}

__attribute__((visibility("default"))) PFN_vkVoidFunction vk_icdGetInstanceProcAddr(void *instance, const char *name) {
    if (!load()) return 0;
    return wrap(name, lvp_gipa(instance, name));
}

__attribute__((visibility("default"))) PFN_vkVoidFunction vk_icdGetPhysicalDeviceProcAddr(void *instance, const char *name) {
    if (!load() || !lvp_gpdpa) return 0;
    return wrap(name, lvp_gpdpa(instance, name));
}
