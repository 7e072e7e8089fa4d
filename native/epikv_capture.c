// See epikv_capture.h for the contract.
#include "epikv_capture.h"

#include "ggml.h"
#include "ggml-backend.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EPIKV_PROBE_BYTES (1 << 20)

struct epikv_capture {
    int32_t   n_layers;
    int32_t   n_embd;
    int32_t   max_tokens;
    int32_t   mode;
    int32_t * layers;      // [n_layers]
    float   * prev;        // [n_layers, n_embd] last hidden state of each layer
    int32_t * has_prev;    // [n_layers]
    float   * g;           // [max_tokens, n_layers] pending g values
    int32_t * n_pending;   // [n_layers] pending rows per layer
    float   * scratch;     // [max_tokens, n_embd] rows copied from the backend
    int64_t   n_captured;
    char    * probe;       // EPIKV_PROBE_BYTES
    size_t    probe_len;
    // attention readback
    int32_t   max_cells;
    float   * attn_sum;    // [max_cells]
    float   * attn_last;   // [max_cells]
    float   * attn_row;    // [max_cells] last token of the current decode, being summed over layers
    int32_t   attn_tokens; // query tokens accumulated since the last take
    int32_t   attn_layers_seen; // kq_soft_max tensors seen in the current ubatch
    float   * attn_scratch;     // grown on demand to hold one kq_soft_max tensor
    size_t    attn_scratch_n;
};

void epikv_diff_norms(const float * rows, int32_t n_rows, int32_t n_embd, float * prev, int32_t has_prev, float * out) {
    for (int32_t r = 0; r < n_rows; ++r) {
        const float * cur = rows + (size_t) r * n_embd;
        const float * ref = r == 0 ? prev : rows + (size_t) (r - 1) * n_embd;
        if (r == 0 && !has_prev) {
            out[r] = NAN;
            continue;
        }
        double acc = 0.0;
        for (int32_t k = 0; k < n_embd; ++k) {
            const double d = (double) cur[k] - (double) ref[k];
            acc += d * d;
        }
        out[r] = (float) sqrt(acc);
    }
    if (n_rows > 0) {
        memcpy(prev, rows + (size_t) (n_rows - 1) * n_embd, (size_t) n_embd * sizeof(float));
    }
}

epikv_capture * epikv_capture_new(const int32_t * layers, int32_t n_layers, int32_t n_embd, int32_t max_tokens) {
    if ((!layers && n_layers > 0) || n_layers < 0 || n_embd <= 0 || max_tokens <= 0) {
        return NULL;
    }
    // a handle with no layers only probes the graph (and reads attention of no layer); allocate at least one
    // slot so that every buffer is a valid pointer
    const int32_t n_slots = n_layers > 0 ? n_layers : 1;
    epikv_capture * cap = calloc(1, sizeof(*cap));
    if (!cap) {
        return NULL;
    }
    cap->n_layers   = n_layers;
    cap->n_embd     = n_embd;
    cap->max_tokens = max_tokens;
    cap->mode       = EPIKV_MODE_CAPTURE;
    cap->layers     = malloc(sizeof(int32_t) * n_slots);
    cap->prev       = calloc((size_t) n_slots * n_embd, sizeof(float));
    cap->has_prev   = calloc(n_slots, sizeof(int32_t));
    cap->g          = calloc((size_t) max_tokens * n_slots, sizeof(float));
    cap->n_pending  = calloc(n_slots, sizeof(int32_t));
    cap->scratch    = malloc((size_t) max_tokens * n_embd * sizeof(float));
    cap->probe      = calloc(EPIKV_PROBE_BYTES, 1);
    if (!cap->layers || !cap->prev || !cap->has_prev || !cap->g || !cap->n_pending || !cap->scratch || !cap->probe) {
        epikv_capture_free(cap);
        return NULL;
    }
    for (int32_t i = 0; i < n_layers; ++i) {
        if (layers[i] < 0) {
            epikv_capture_free(cap);
            return NULL;
        }
        cap->layers[i] = layers[i];
    }
    return cap;
}

void epikv_capture_free(epikv_capture * cap) {
    if (!cap) {
        return;
    }
    free(cap->layers);
    free(cap->prev);
    free(cap->has_prev);
    free(cap->g);
    free(cap->n_pending);
    free(cap->scratch);
    free(cap->probe);
    free(cap->attn_sum);
    free(cap->attn_last);
    free(cap->attn_row);
    free(cap->attn_scratch);
    free(cap);
}

int32_t epikv_capture_set_mode(epikv_capture * cap, int32_t mode) {
    if (mode & ~(EPIKV_MODE_CAPTURE | EPIKV_MODE_PROBE | EPIKV_MODE_ATTN)) {
        return -1;
    }
    if ((mode & EPIKV_MODE_ATTN) && !cap->attn_sum) {
        return -1;
    }
    cap->mode      = mode;
    cap->probe_len = 0;
    cap->probe[0]  = '\0';
    return 0;
}

// index of the configured layer named by t ("<prefix><il>"), or -1
static int32_t epikv_named_slot(const epikv_capture * cap, const struct ggml_tensor * t, const char * prefix) {
    const char * name = t->name;
    const size_t n = strlen(prefix);
    if (strncmp(name, prefix, n) != 0) {
        return -1;
    }
    char * end = NULL;
    const long il = strtol(name + n, &end, 10);
    if (end == name + n || *end != '\0') {
        return -1;
    }
    for (int32_t i = 0; i < cap->n_layers; ++i) {
        if (cap->layers[i] == il) {
            return i;
        }
    }
    return -1;
}

static int32_t epikv_layer_slot(const epikv_capture * cap, const struct ggml_tensor * t) {
    return epikv_named_slot(cap, t, "l_out-");
}

static int32_t epikv_attn_slot(const epikv_capture * cap, const struct ggml_tensor * t) {
    return epikv_named_slot(cap, t, "kq_soft_max-");
}

int32_t epikv_capture_enable_attention(epikv_capture * cap, int32_t max_cells) {
    if (max_cells <= 0) {
        return -1;
    }
    free(cap->attn_sum);
    free(cap->attn_last);
    free(cap->attn_row);
    cap->attn_sum  = calloc(max_cells, sizeof(float));
    cap->attn_last = calloc(max_cells, sizeof(float));
    cap->attn_row  = calloc(max_cells, sizeof(float));
    cap->max_cells = max_cells;
    cap->attn_tokens = 0;
    cap->attn_layers_seen = 0;
    if (!cap->attn_sum || !cap->attn_last || !cap->attn_row) {
        return -1;
    }
    return 0;
}

// kq_soft_max-<il>: [n_kv, n_tokens, n_head(, n_stream)] attention weights of one ubatch
static void epikv_attn_accumulate(epikv_capture * cap, struct ggml_tensor * t) {
    const int64_t n_kv = t->ne[0], n_tok = t->ne[1], n_head = t->ne[2] * t->ne[3];
    if (n_kv > cap->max_cells) {
        return; // more columns than cells: cannot happen for a context of at most max_cells cells
    }
    const size_t need = (size_t) n_kv * n_tok * n_head;
    if (need > cap->attn_scratch_n) {
        float * grown = realloc(cap->attn_scratch, need * sizeof(float));
        if (!grown) {
            return; // out of memory: this step's attention is dropped
        }
        cap->attn_scratch   = grown;
        cap->attn_scratch_n = need;
    }
    ggml_backend_tensor_get(t, cap->attn_scratch, 0, ggml_nbytes(t));
    const float w = 1.0f / (float) (n_head * cap->n_layers);
    for (int64_t h = 0; h < n_head; ++h) {
        for (int64_t q = 0; q < n_tok; ++q) {
            const float * row = cap->attn_scratch + (size_t) (h * n_tok + q) * n_kv;
            for (int64_t c = 0; c < n_kv; ++c) {
                cap->attn_sum[c] += w * row[c];
            }
            if (q == n_tok - 1) {
                for (int64_t c = 0; c < n_kv; ++c) {
                    cap->attn_row[c] += w * row[c];
                }
            }
        }
    }
    cap->attn_layers_seen++;
    if (cap->attn_layers_seen == cap->n_layers) {
        // all layers of this ubatch seen: its last query token is the newest
        memcpy(cap->attn_last, cap->attn_row, sizeof(float) * cap->max_cells);
        memset(cap->attn_row, 0, sizeof(float) * cap->max_cells);
        cap->attn_layers_seen = 0;
        cap->attn_tokens += (int32_t) n_tok;
    }
}

int32_t epikv_capture_take_attention(epikv_capture * cap, float * sum_out, float * last_out, int32_t n_cells) {
    if (!cap->attn_sum) {
        return -1;
    }
    const int32_t n = n_cells < cap->max_cells ? n_cells : cap->max_cells;
    memcpy(sum_out, cap->attn_sum, sizeof(float) * n);
    memcpy(last_out, cap->attn_last, sizeof(float) * n);
    for (int32_t c = n; c < n_cells; ++c) {
        sum_out[c] = 0.0f;
        last_out[c] = 0.0f;
    }
    memset(cap->attn_sum, 0, sizeof(float) * cap->max_cells);
    const int32_t tokens = cap->attn_tokens;
    cap->attn_tokens = 0;
    return tokens;
}

static void epikv_probe_record(epikv_capture * cap, const struct ggml_tensor * t) {
    const size_t room = EPIKV_PROBE_BYTES - cap->probe_len;
    const int n = snprintf(cap->probe + cap->probe_len, room, "%s\t%s\n", t->name, ggml_op_name(t->op));
    if (n > 0 && (size_t) n < room) {
        cap->probe_len += (size_t) n;
    } else {
        cap->probe[cap->probe_len] = '\0';
    }
}

bool epikv_capture_cb_eval(struct ggml_tensor * t, bool ask, void * user_data) {
    epikv_capture * cap = (epikv_capture *) user_data;

    if (ask) {
        if (cap->mode & EPIKV_MODE_PROBE) {
            epikv_probe_record(cap, t);
        }
        return ((cap->mode & EPIKV_MODE_CAPTURE) && epikv_layer_slot(cap, t) >= 0) ||
               ((cap->mode & EPIKV_MODE_ATTN) && epikv_attn_slot(cap, t) >= 0);
    }

    if ((cap->mode & EPIKV_MODE_ATTN) && epikv_attn_slot(cap, t) >= 0) {
        if (t->type == GGML_TYPE_F32 && ggml_is_contiguous(t)) {
            epikv_attn_accumulate(cap, t);
        }
        return true;
    }

    // data phase: never return false here, it would silently skip the rest of the graph
    const int32_t slot = epikv_layer_slot(cap, t);
    if (slot < 0 || t->type != GGML_TYPE_F32 || t->ne[0] != cap->n_embd || !ggml_is_contiguous(t)) {
        return true;
    }
    const int32_t n_rows = (int32_t) ggml_nrows(t);
    if (n_rows <= 0 || cap->n_pending[slot] + n_rows > cap->max_tokens) {
        return true; // take() reports the mismatch
    }

    ggml_backend_tensor_get(t, cap->scratch, 0, ggml_nbytes(t));

    float out_col[1];
    for (int32_t r = 0; r < n_rows; ++r) {
        // one row at a time, so that g lands in column `slot` of the [max_tokens, n_layers] buffer
        epikv_diff_norms(cap->scratch + (size_t) r * cap->n_embd, 1, cap->n_embd,
                         cap->prev + (size_t) slot * cap->n_embd, cap->has_prev[slot], out_col);
        cap->has_prev[slot] = 1;
        cap->g[(size_t) (cap->n_pending[slot] + r) * cap->n_layers + slot] = out_col[0];
    }
    cap->n_pending[slot] += n_rows;
    cap->n_captured++;
    return true;
}

int32_t epikv_capture_take(epikv_capture * cap, float * g_out, int32_t max_rows) {
    if (cap->n_layers == 0) {
        return 0;
    }
    const int32_t n = cap->n_pending[0];
    int32_t status = n;
    for (int32_t i = 1; i < cap->n_layers; ++i) {
        if (cap->n_pending[i] != n) {
            status = -1;
        }
    }
    if (status >= 0 && n > max_rows) {
        return -2;
    }
    if (status >= 0 && n > 0) {
        memcpy(g_out, cap->g, (size_t) n * cap->n_layers * sizeof(float));
    }
    for (int32_t i = 0; i < cap->n_layers; ++i) {
        cap->n_pending[i] = 0;
    }
    return status;
}

void epikv_capture_reset(epikv_capture * cap) {
    for (int32_t i = 0; i < cap->n_layers; ++i) {
        cap->has_prev[i]  = 0;
        cap->n_pending[i] = 0;
    }
}

int64_t epikv_capture_n_captured(const epikv_capture * cap) {
    return cap->n_captured;
}

const char * epikv_capture_probe_text(const epikv_capture * cap) {
    return cap->probe;
}
