// epikv_capture: per-layer residual-stream change captured through llama.cpp's eval callback.
//
// This is the "plain" capture route: it works on an unpatched llama.cpp graph, by asking the scheduler for
// the tensors named "l_out-<il>". The scheduler splits the graph at every tensor that the callback asks for
// (one synchronisation per captured layer on a GPU), which is why the patched route
// (llama_set_layer_capture / llama_get_layer_capture, patches/0001) is preferred. Both routes are measured in
// scripts/bench_overhead.py.
//
// Ownership: epikv_capture_new returns a handle owned by the caller and released with epikv_capture_free.
// The handle is the cb_eval user_data of exactly one llama_context and must outlive it.
// Thread-safety: none; llama.cpp calls cb_eval from the thread that calls llama_decode.

#pragma once

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_tensor;

// Mode bits, combinable (0 = idle: every node is answered "no" at the cost of one call).
#define EPIKV_MODE_CAPTURE 1  // capture the l_out-<il> tensors of the configured layers
#define EPIKV_MODE_PROBE   2  // record "<name>\t<op>\n" for every node of the graphs computed meanwhile
#define EPIKV_MODE_ATTN    4  // accumulate the attention weights "kq_soft_max-<il>" (flash attention off)

typedef struct epikv_capture epikv_capture;

// Create a capture of the layers layers[0..n_layers) (each in [0, n_layer - 1) of the model), for hidden
// states of n_embd floats, for batches of at most max_tokens tokens. n_layers may be 0 (layers may then be
// NULL): such a handle only probes the graph. Returns NULL on invalid arguments or when out of memory.
epikv_capture * epikv_capture_new(const int32_t * layers, int32_t n_layers, int32_t n_embd, int32_t max_tokens);

void epikv_capture_free(epikv_capture * cap);

// Set the mode (a combination of EPIKV_MODE_* bits) and clear the probe text. Returns 0, or -1 for unknown bits.
int32_t epikv_capture_set_mode(epikv_capture * cap, int32_t mode);

// The ggml_backend_sched_eval_callback to put in llama_context_params.cb_eval, with the handle as
// cb_eval_user_data. Ask phase: true only for "l_out-<il>" of a configured layer in CAPTURE mode.
// Data phase: copies the rows (ggml_backend_tensor_get, so any backend works) and stores per-token L2
// differences; it always returns true, so the rest of the graph is never skipped.
bool epikv_capture_cb_eval(struct ggml_tensor * t, bool ask, void * user_data);

// Move the g values captured since the last call into g_out, row-major [n_tokens, n_layers] (float32,
// units of the hidden-state L2 norm; NaN for the first token of a sequence whose previous state is unknown).
// Returns the number of tokens written (>= 0), -1 if the layers captured unequal token counts (a layer
// missing from the graph), -2 if more than max_rows tokens are pending.
int32_t epikv_capture_take(epikv_capture * cap, float * g_out, int32_t max_rows);

// Attention readback (EPIKV_MODE_ATTN, needs flash attention off so that kq_soft_max exists). Allocates
// accumulators for up to max_cells KV cells. Returns 0, -1 when out of memory or max_cells <= 0.
int32_t epikv_capture_enable_attention(epikv_capture * cap, int32_t max_cells);

// Move the attention accumulated since the last call into sum_out and last_out ([n_cells] each, column c =
// KV cell c; cells beyond the graph's n_kv get 0). Both are averaged over the captured layers and heads, so
// every query token contributes a total mass of 1:
//   sum_out[c]  = sum over the query tokens of the decodes since the last take (H2O "attention received"),
//   last_out[c] = the last query token of the last decode (TOVA).
// Returns the number of query tokens accumulated (>= 0), -1 if attention capture is not enabled.
int32_t epikv_capture_take_attention(epikv_capture * cap, float * sum_out, float * last_out, int32_t n_cells);

// Forget the previous hidden state of every layer (the next token's g is NaN). Call at a sequence start.
void epikv_capture_reset(epikv_capture * cap);

// Number of "l_out" tensors seen in the data phase since creation (diagnostics).
int64_t epikv_capture_n_captured(const epikv_capture * cap);

// Probe mode: the recorded node list, "<name>\t<op>\n" lines, NUL-terminated; valid until the next call of
// epikv_capture_set_mode. Nodes beyond the internal buffer (1 MiB) are dropped.
const char * epikv_capture_probe_text(const epikv_capture * cap);

// L2 norms of consecutive row differences: out[i] = ||rows[i] - rows[i-1]||, with rows[-1] = prev.
// rows: [n_rows, n_embd] float32; prev: [n_embd] (updated to rows[n_rows-1]); has_prev == 0 gives out[0] = NaN.
void epikv_diff_norms(const float * rows, int32_t n_rows, int32_t n_embd, float * prev, int32_t has_prev, float * out);

#ifdef __cplusplus
}
#endif
