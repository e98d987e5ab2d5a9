// Does llama.cpp's Vulkan backend accumulate in float16? One ggml_mul_mat of an F16 matrix of ones (K x M) by ones
// (K x N, F16) on Vulkan device 0: every output is K exactly in float32 sums, but a float16 running sum stops at 2048
// (2048 + 1 rounds back to 2048), so K = 4096 tells the two apart. N = 1 takes ggml's matrix-vector path (one-token
// decode), N > 1 its matrix-matrix path (prompt processing). Built by scripts/setup-llama-vulkan against the ggml the
// tests run; run by tests/test_llama_vulkan.py and bench/runtimes/llama_vulkan.py.
// Usage: f16_probe K M N [K M N ...]. Prints one JSON line per product: the device, K, M, N and the outputs' min and
// max; exit 3 without a Vulkan device, 4 if a graph does not compute.
#include <stdio.h>
#include <stdlib.h>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-vulkan.h"
#include "ggml.h"

// One product of ones on `backend`: the outputs' min and max, or 0 if the graph did not compute.
static int product_of_ones(ggml_backend_t backend, int k, int m, int n, float * lo, float * hi) {
    struct ggml_init_params params = {ggml_tensor_overhead() * 4 + ggml_graph_overhead(), NULL, true};
    struct ggml_context * ctx = ggml_init(params);
    struct ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, k, m);
    struct ggml_tensor * b = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, k, n);
    struct ggml_tensor * c = ggml_mul_mat(ctx, a, b);  // F32, M x N, at the default precision llama.cpp's weights get
    struct ggml_cgraph * graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, c);
    ggml_backend_buffer_t buffer = ggml_backend_alloc_ctx_tensors(ctx, backend);
    const size_t count = (size_t) k * (m > n ? m : n);
    ggml_fp16_t * ones = malloc(count * sizeof *ones);
    float * out = malloc((size_t) m * n * sizeof *out);
    for (size_t i = 0; i < count; i++) {
        ones[i] = ggml_fp32_to_fp16(1.0f);
    }
    ggml_backend_tensor_set(a, ones, 0, ggml_nbytes(a));
    ggml_backend_tensor_set(b, ones, 0, ggml_nbytes(b));
    const int ok = ggml_backend_graph_compute(backend, graph) == GGML_STATUS_SUCCESS;
    if (ok) {
        ggml_backend_tensor_get(c, out, 0, ggml_nbytes(c));
        *lo = *hi = out[0];
        for (size_t i = 1; i < (size_t) m * n; i++) {
            *lo = out[i] < *lo ? out[i] : *lo;
            *hi = out[i] > *hi ? out[i] : *hi;
        }
    }
    free(ones);
    free(out);
    ggml_backend_buffer_free(buffer);
    ggml_free(ctx);
    return ok;
}

int main(int argc, char ** argv) {
    if (argc < 4 || (argc - 1) % 3 != 0) {
        fprintf(stderr, "usage: f16_probe K M N [K M N ...]\n");
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        if (atoi(argv[i]) <= 0) {
            fprintf(stderr, "f16_probe: K, M and N must be positive integers, not %s\n", argv[i]);
            return 2;
        }
    }
    if (ggml_backend_vk_get_device_count() < 1) {
        fprintf(stderr, "f16_probe: no Vulkan device (GGML_VK_VISIBLE_DEVICES=0 lets ggml use a CPU device)\n");
        return 3;
    }
    char device[256];
    ggml_backend_vk_get_device_description(0, device, sizeof device);
    ggml_backend_t backend = ggml_backend_vk_init(0);
    if (backend == NULL) {
        fprintf(stderr, "f16_probe: ggml_backend_vk_init(0) failed\n");
        return 3;
    }
    for (int i = 1; i + 2 < argc; i += 3) {
        const int k = atoi(argv[i]), m = atoi(argv[i + 1]), n = atoi(argv[i + 2]);
        float lo, hi;
        if (!product_of_ones(backend, k, m, n, &lo, &hi)) {
            fprintf(stderr, "f16_probe: the graph did not compute\n");
            return 4;
        }
        // the description is the driver's own text: its quotes, backslashes and control characters kept out of the JSON
        printf("{\"device\": \"");
        for (const char * p = device; *p; p++) {
            if (*p == '"' || *p == '\\') {
                putchar('\\');
            }
            putchar((unsigned char) *p >= 0x20 ? *p : ' ');
        }
        printf("\", \"k\": %d, \"m\": %d, \"n\": %d, \"min\": %.9g, \"max\": %.9g}\n", k, m, n, lo, hi);
    }
    ggml_backend_free(backend);
    return 0;
}
