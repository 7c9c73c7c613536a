/* hf.c — weights from elsewhere (--init) and out to Hugging Face (--export-hf).
 *
 * A run can start from weights instead of random values: a Hugging Face model (a
 * `model.safetensors`, a sharded one with `model.safetensors.index.json`, next to its
 * `config.json`) of the two families fp8c's models follow, GPT-2 (GPT2LMHeadModel) and Llama
 * (LlamaForCausalLM), or the weights of any fp8c checkpoint. Only the weights are taken: the
 * optimizer starts afresh, and masters, FP8 copies and scales are derived from the weights by
 * init.c exactly as from random ones, at whatever -O level this binary was built for.
 *
 * fp8c's parameter names are Hugging Face's (models/gpt2.model drops GPT-2's "transformer."
 * prefix), so the mapping is a name and, for a few tensors, a change of layout:
 *
 *   GPT-2   Linear layers are HF's Conv1D, stored (in, out); fp8c stores (out, in) as
 *           nn.Linear does: the four matrices of each block are transposed. The head is the
 *           embedding (tied): a file's lm_head.weight, if any, is not read. The causal-mask
 *           buffers some files hold (h.N.attn.bias, h.N.attn.masked_bias) are not weights.
 *   Llama   HF rotates the halves (i, i + D/2) of each head; fp8c's rope rotates the pairs
 *           (2i, 2i+1), both by angle pos * theta^(-2i/D). The rows of q_proj and k_proj are
 *           permuted per head so that HF's row p*D/2 + i lands on fp8c's row 2i + p: q and k
 *           then hold the same numbers in another order, both permuted alike, so every q.k and
 *           the whole forward are unchanged (this is the inverse of the permutation HF's
 *           convert_llama_weights_to_hf.py applies to Meta's interleaved weights). With
 *           tie_word_embeddings, lm_head.weight is the embedding.
 *
 * Everything is checked before a value is written: the family (config.json's model_type, else
 * the names) against the model's, the config's heads, key-value heads, head size, norm epsilon,
 * rope theta and activation against the graph's (a different one would compute another
 * function), and the set of tensors: every missing, extra or mis-shaped tensor is named in one
 * error line. The export writes the same layout back (transposes and permutation inverted, the
 * tied head omitted) from each parameter's most precise copy: its f32 master, or the bf16
 * weight plus the i8 correction of a split master (ir/codecs.c), or the weight itself; so an
 * export read back with --init gives the same weights bit for bit (for a split master, the same
 * decoded values: init.c re-encodes them exactly). */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "rt.h"

/* ---------------------------------------------------------------- the model in the graph */

typedef enum { FAM_NONE, FAM_GPT2, FAM_LLAMA } Family;

static const char *const family_names[] = {"?", "gpt2", "llama"};

/* What the graph computes, as far as a config.json describes it; 0 where the graph has none. */
typedef struct {
    Family family;
    int64_t heads, kv_heads, head_dim;   /* attention; head_dim from rope (Llama) */
    double theta, eps;                   /* rope theta; the norms' epsilon */
    int64_t layers, dim, vocab, hidden, max_seq;
} ModelInfo;

static Node *hf_param(const Graph *g, const char *name) {
    Node *n = ir_find(g, name);
    return n && n->op == OP_PARAM ? n : NULL;
}

static bool hf_model_info(const Graph *g, ModelInfo *m) {
    memset(m, 0, sizeof *m);
    Node *emb = NULL;
    if ((emb = hf_param(g, "wte.weight"))) m->family = FAM_GPT2;
    else if ((emb = hf_param(g, "model.embed_tokens.weight"))) m->family = FAM_LLAMA;
    else {
        rt_error("the model's parameters follow neither GPT-2's names (wte.weight, h.N...) nor "
                 "Llama's (model.embed_tokens.weight, model.layers.N...): Hugging Face weights "
                 "are read for those two families only");
        return false;
    }
    m->vocab = emb->t.dims[0];
    m->dim = emb->t.dims[1];
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *n = g->nodes[i];
        if (n->op == OP_ATTENTION && !m->heads) {
            m->heads = IR_IATTR(n, ATTENTION, heads);
            m->kv_heads = IR_IATTR(n, ATTENTION, kv_heads);
        } else if (n->op == OP_ROPE && !IR_IATTR(n, ROPE, inverse) && !m->head_dim) {
            m->head_dim = IR_IATTR(n, ROPE, head_dim);
            m->theta = IR_FATTR(n, ROPE, theta);
        } else if ((n->op == OP_LAYERNORM || n->op == OP_RMSNORM) && !m->eps) {
            m->eps = IR_FATTR(n, LAYERNORM, eps);   /* RMSNORM keeps eps at the same place */
        } else if (n->op == OP_PARAM && n->t.name) {
            int layer = -1;
            if (sscanf(n->t.name, m->family == FAM_GPT2 ? "h.%d." : "model.layers.%d.", &layer) == 1 &&
                layer + 1 > m->layers)
                m->layers = layer + 1;
            const char *e = m->family == FAM_GPT2 ? ".mlp.c_fc.weight" : ".mlp.up_proj.weight";
            size_t ln = strlen(n->t.name), le = strlen(e);
            if (ln > le && strcmp(n->t.name + ln - le, e) == 0) m->hidden = n->t.dims[0];
        }
    }
    const Node *wpe = hf_param(g, "wpe.weight");
    m->max_seq = wpe ? wpe->t.dims[0] : g->seq;
    if (m->heads && !m->head_dim) m->head_dim = m->dim / m->heads;
    return true;
}

/* How a parameter's stored layout differs between the two. */
typedef enum { CONV_NONE, CONV_TRANSPOSE, CONV_ROPE } Conv;

static bool hf_ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static Conv hf_conv(const ModelInfo *m, const Node *p) {
    const char *name = p->t.name;
    if (m->family == FAM_GPT2)   /* every matrix of a block is a Conv1D */
        return p->t.rank == 2 && strncmp(name, "h.", 2) == 0 && hf_ends_with(name, ".weight")
                   ? CONV_TRANSPOSE : CONV_NONE;
    if (hf_ends_with(name, ".self_attn.q_proj.weight") || hf_ends_with(name, ".self_attn.k_proj.weight"))
        return CONV_ROPE;
    return CONV_NONE;
}

/* Tensors of a Hugging Face file that are not weights fp8c trains. */
static bool hf_ignored(Family f, const char *name) {
    if (f == FAM_GPT2)
        return strcmp(name, "lm_head.weight") == 0 || hf_ends_with(name, ".attn.bias") ||
               hf_ends_with(name, ".attn.masked_bias");
    return hf_ends_with(name, ".rotary_emb.inv_freq");
}

/* fp8c (rows, cols) x <-> the file's layout y. to_file: x -> y, else y -> x. For CONV_ROPE,
 * row h*D + 2i + p of fp8c is row h*D + p*D/2 + i of the file. */
static void hf_convert(Conv c, const Tensor *t, int64_t head_dim, const float *src, float *dst,
                       bool to_file) {
    int64_t n = ir_numel(t);
    if (c == CONV_NONE) {
        memcpy(dst, src, (size_t)n * sizeof *dst);
        return;
    }
    int64_t rows = t->dims[0], cols = n / rows;
    for (int64_t r = 0; r < rows; r++) {
        if (c == CONV_TRANSPOSE) {
            for (int64_t k = 0; k < cols; k++) {
                if (to_file) dst[k * rows + r] = src[r * cols + k];
                else dst[r * cols + k] = src[k * rows + r];
            }
            continue;
        }
        int64_t D = head_dim, h = r / D, i = (r % D) / 2, p = r % 2;
        int64_t f = h * D + p * (D / 2) + i;     /* the file's row */
        if (to_file) memcpy(dst + f * cols, src + r * cols, (size_t)cols * sizeof *dst);
        else memcpy(dst + r * cols, src + f * cols, (size_t)cols * sizeof *dst);
    }
}

/* ---------------------------------------------------------------- the source of --init */

typedef struct {
    const char *name;
    RtStFile *file;
    const RtStEntry *e;
    bool used;
} SrcTensor;

typedef struct {
    char where[4096];           /* what the messages name: the path given */
    RtStFile *files;
    int n_files;
    SrcTensor *ts;
    int n;
    Jv config;                  /* kind JV_NULL when there is none */
    char config_path[4200];
    bool fp8c;                  /* an fp8c checkpoint */
    Family family;
    /* the binding of each parameter, in graph order (by node index) */
    const SrcTensor **src;      /* the values (fp8c: the f32 master, or the weight) */
    const SrcTensor **hi;       /* fp8c split master: the bf16 weight holding the high half */
    Conv *conv;
    int64_t head_dim;
} Source;

static void src_free(Source *s) {
    for (int i = 0; i < s->n_files; i++) rt_st_close(&s->files[i]);
    free(s->files);
    free(s->ts);
    free(s->src);
    free(s->hi);
    free(s->conv);
    rt_json_free(&s->config);
}

static const SrcTensor *src_find(const Source *s, const char *name) {
    for (int i = 0; i < s->n; i++)
        if (strcmp(s->ts[i].name, name) == 0) return &s->ts[i];
    return NULL;
}

static bool src_add_file(Source *s, const char *path) {
    for (int i = 0; i < s->n_files; i++)
        if (strcmp(s->files[i].path, path) == 0) return true;
    RtStFile *grown = realloc(s->files, (size_t)(s->n_files + 1) * sizeof *grown);
    if (!grown) {
        rt_error("out of memory");
        return false;
    }
    s->files = grown;
    return rt_st_open(&s->files[s->n_files], path) && ++s->n_files;
}

/* Lists every tensor of the files; a name in two shards is an error. */
static bool src_index(Source *s) {
    int total = 0;
    for (int i = 0; i < s->n_files; i++) total += s->files[i].n_entries;
    s->ts = calloc((size_t)(total ? total : 1), sizeof *s->ts);
    if (!s->ts) {
        rt_error("out of memory");
        return false;
    }
    for (int i = 0; i < s->n_files; i++)
        for (int k = 0; k < s->files[i].n_entries; k++) {
            const RtStEntry *e = &s->files[i].entries[k];
            const SrcTensor *dup = src_find(s, e->name);
            if (dup) {
                rt_error("%s: tensor %s is in two files, %s and %s", s->where, e->name,
                         dup->file->path, s->files[i].path);
                return false;
            }
            s->ts[s->n++] = (SrcTensor){.name = e->name, .file = &s->files[i], .e = e};
        }
    return true;
}

static bool hf_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static bool hf_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0;
}

/* The shards a model.safetensors.index.json names (its weight_map's values), relative to it. */
static bool src_open_index(Source *s, const char *index) {
    Jv v;
    if (!rt_json_read(index, &v)) return false;
    const Jv *map = rt_json_get(&v, "weight_map");
    bool ok = true;
    if (!map || map->kind != JV_OBJ || !map->n) {
        rt_error("%s: has no weight_map naming the shards", index);
        ok = false;
    }
    const char *slash = strrchr(index, '/');
    int dir_len = slash ? (int)(slash - index + 1) : 0;
    for (int i = 0; ok && i < map->n; i++) {
        const Jv *file = &map->items[i];
        if (file->kind != JV_STR || !*file->str || strchr(file->str, '/')) {
            rt_error("%s: weight_map entry %s does not name a file beside the index", index,
                     map->keys[i]);
            ok = false;
            break;
        }
        char path[4096];
        snprintf(path, sizeof path, "%.*s%s", dir_len, index, file->str);
        ok = src_add_file(s, path);
    }
    /* every name the map lists must be in the shard it names */
    for (int i = 0; ok && i < map->n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%.*s%s", dir_len, index, map->items[i].str);
        for (int f = 0; f < s->n_files; f++)
            if (strcmp(s->files[f].path, path) == 0 && !rt_st_find(&s->files[f], map->keys[i])) {
                rt_error("%s: tensor %s is not in %s, where the index puts it", index,
                         map->keys[i], path);
                ok = false;
                break;
            }
    }
    rt_json_free(&v);
    return ok;
}

/* PATH: a directory (its latest, if it holds an fp8c run; else model.safetensors or the
 * sharded index, and config.json), an index file, or a safetensors file (config.json beside
 * it is read if present). */
static bool src_open(Source *s, const char *path) {
    memset(s, 0, sizeof *s);
    snprintf(s->where, sizeof s->where, "%s", path);
    char file[4300] = "", dir[4096];
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    if (strcmp(base, "config.json") == 0)   /* the model's config: its directory is meant */
        snprintf(dir, sizeof dir, "%.*s", base == path ? 1 : (int)(base - path), base == path ? "." : path);
    if (hf_is_dir(path) || strcmp(base, "config.json") == 0) {
        if (strcmp(base, "config.json") != 0) snprintf(dir, sizeof dir, "%s", path);
        size_t n = strlen(dir);
        while (n > 1 && dir[n - 1] == '/') dir[--n] = 0;
        char probe[4200];
        snprintf(probe, sizeof probe, "%s/latest", dir);
        if (hf_exists(probe)) {
            if (!rt_ckpt_resolve(dir, file, sizeof file)) return false;
        } else {
            snprintf(probe, sizeof probe, "%s/model.safetensors.index.json", dir);
            if (!hf_exists(probe)) snprintf(probe, sizeof probe, "%s/model.safetensors", dir);
            if (!hf_exists(probe)) {
                rt_error("%s: holds no model.safetensors, model.safetensors.index.json or fp8c "
                         "checkpoint (latest)", path);
                return false;
            }
            snprintf(file, sizeof file, "%s", probe);
        }
    } else {
        FILE *f = rt_open_regular(path, "cannot read the weights", NULL);
        if (!f) return false;
        fclose(f);
        snprintf(file, sizeof file, "%s", path);
        const char *slash = strrchr(file, '/');
        snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - file) : 1, slash ? file : ".");
    }
    bool ok = hf_ends_with(file, ".json") ? src_open_index(s, file) : src_add_file(s, file);
    if (!ok || !src_index(s)) return false;
    const char *format = s->n_files == 1 ? rt_ckpt_meta_get(s->files[0].meta, s->files[0].n_meta,
                                                            "format") : NULL;
    s->fp8c = format && strcmp(format, "fp8c") == 0;
    snprintf(s->config_path, sizeof s->config_path, "%s/config.json", dir);
    if (!s->fp8c && hf_exists(s->config_path) && !rt_json_read(s->config_path, &s->config))
        return false;
    return true;
}

/* ---------------------------------------------------------------- checks */

/* What does not fit, for one error line that names every tensor. The same problem in every
 * layer is written once, with the layers as ranges: "missing model.layers.{0-21}.mlp.up_proj
 * .weight" rather than 22 names. */
enum { PROB_MISSING, PROB_EXTRA, PROB_SHAPE };
typedef struct {
    int kind;
    char *name;
    char *detail;               /* mis-shaped: " is [..], the model needs [..]" */
} Problem;
typedef struct {
    Problem *p;
    int n;
    bool failed;                /* out of memory */
} Problems;

static void problem(Problems *pr, int kind, const char *name, const char *detail) {
    Problem *grown = realloc(pr->p, (size_t)(pr->n + 1) * sizeof *grown);
    if (!grown) {
        pr->failed = true;
        return;
    }
    pr->p = grown;
    grown[pr->n++] = (Problem){kind, strdup(name), strdup(detail ? detail : "")};
}

/* The name with its first all-digit component (the layer) cut out: prefix and suffix around
 * it, and the number; -1 when there is none. */
static int64_t problem_layer(const char *name, size_t *pre, const char **post) {
    for (const char *c = name; *c; c++) {
        if (c != name && c[-1] != '.') continue;
        const char *e = c;
        while (*e >= '0' && *e <= '9') e++;
        if (e > c && (*e == '.' || !*e) && e - c < 10) {
            *pre = (size_t)(c - name);
            *post = e;
            return strtoll(c, NULL, 10);
        }
    }
    return -1;
}

static bool problems_report(Problems *pr, const char *where, const char *model) {
    static const char *const heads[] = {"missing", "extra", "mis-shaped"};
    if (!pr->n && !pr->failed) return true;
    StrBuf text = {0};
    bool *done = calloc((size_t)pr->n + 1, sizeof *done);
    int64_t *layers = malloc(((size_t)pr->n + 1) * sizeof *layers);
    if (!done || !layers || pr->failed) {
        rt_error("%s: does not fit model %s (out of memory listing what)", where, model);
    } else {
        for (int k = 0; k < 3; k++) {
            bool first = true;
            for (int i = 0; i < pr->n; i++) {
                const Problem *a = &pr->p[i];
                if (a->kind != k || done[i]) continue;
                strbuf_add(&text, first ? (*strbuf_text(&text) ? "; " : "") : ", ");
                if (first) strbuf_printf(&text, "%s ", heads[k]);
                first = false;
                size_t pre;
                const char *post;
                int64_t layer = problem_layer(a->name, &pre, &post);
                int n = 0;
                for (int j = i; layer >= 0 && j < pr->n; j++) {
                    const Problem *b = &pr->p[j];
                    size_t pre_b;
                    const char *post_b;
                    int64_t lb = b->kind == k && !done[j] ? problem_layer(b->name, &pre_b, &post_b) : -1;
                    if (lb < 0 || pre_b != pre || strncmp(a->name, b->name, pre) || strcmp(post, post_b) ||
                        strcmp(a->detail, b->detail))
                        continue;
                    done[j] = true;
                    layers[n++] = lb;
                }
                done[i] = true;
                if (n <= 1) {
                    strbuf_printf(&text, "%s%s", a->name, a->detail);
                    continue;
                }
                /* the layers in order, as ranges */
                for (int x = 1; x < n; x++)
                    for (int y = x; y > 0 && layers[y - 1] > layers[y]; y--) {
                        int64_t t = layers[y];
                        layers[y] = layers[y - 1], layers[y - 1] = t;
                    }
                strbuf_printf(&text, "%.*s{", (int)pre, a->name);
                for (int x = 0; x < n;) {
                    int y = x;
                    while (y + 1 < n && layers[y + 1] == layers[y] + 1) y++;
                    strbuf_printf(&text, "%s%lld", x ? "," : "", (long long)layers[x]);
                    if (y > x) strbuf_printf(&text, "-%lld", (long long)layers[y]);
                    x = y + 1;
                }
                strbuf_printf(&text, "}%s%s", post, a->detail);
            }
        }
        rt_error("%s: does not fit model %s: %s", where, model, strbuf_text(&text));
    }
    strbuf_free(&text);
    free(done);
    free(layers);
    return false;
}

static void problems_free(Problems *pr) {
    for (int i = 0; i < pr->n; i++) free(pr->p[i].name), free(pr->p[i].detail);
    free(pr->p);
}

static void shape_text(char *buf, size_t n, int rank, const int64_t *dims) {
    size_t k = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < rank && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, "%s%lld", i ? "," : "", (long long)dims[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
}

/* A config.json number against the graph's; absent keys pass (their defaults are checked by
 * the caller where they matter). */
static bool cfg_int(const Source *s, const char *key, int64_t have, const char *what, const char *flag) {
    const Jv *v = rt_json_get(&s->config, key);
    if (!v || v->kind == JV_NULL) return true;
    if (v->kind != JV_NUM || v->num != (double)have) {
        char val[64];
        if (v->kind == JV_NUM) snprintf(val, sizeof val, "%.17g", v->num);
        else snprintf(val, sizeof val, "not a number");
        char hint[96] = "";
        if (flag && v->kind == JV_NUM) snprintf(hint, sizeof hint, " (build it with -D %s=%s)", flag, val);
        rt_error("%s: %s is %s, the model has %lld %s%s", s->config_path, key, val,
                 (long long)have, what, hint);
        return false;
    }
    return true;
}

static bool cfg_real(const Source *s, const char *key, double have, double dflt, const char *what) {
    const Jv *v = rt_json_get(&s->config, key);
    double want = v && v->kind == JV_NUM ? v->num : dflt;
    if (v && v->kind != JV_NUM && v->kind != JV_NULL) {
        rt_error("%s: %s is not a number", s->config_path, key);
        return false;
    }
    if (!(fabs(want - have) <= 1e-6 * fabs(have))) {
        rt_error("%s: %s is %g, the model's %s is %g", s->config_path, key, want, what, have);
        return false;
    }
    return true;
}

static bool cfg_str(const Source *s, const char *key, const char *const *allowed, const char *what) {
    const Jv *v = rt_json_get(&s->config, key);
    if (!v || v->kind == JV_NULL) return true;
    for (int i = 0; allowed[i]; i++)
        if (v->kind == JV_STR && strcmp(v->str, allowed[i]) == 0) return true;
    rt_error("%s: %s is %s%s%s, the model computes %s", s->config_path, key,
             v->kind == JV_STR ? "\"" : "", v->kind == JV_STR ? v->str : "not a string",
             v->kind == JV_STR ? "\"" : "", what);
    return false;
}

static bool cfg_false(const Source *s, const char *key, const char *what) {
    const Jv *v = rt_json_get(&s->config, key);
    if (!v || v->kind == JV_NULL || (v->kind == JV_BOOL && !v->num)) return true;
    rt_error("%s: %s is set: %s", s->config_path, key, what);
    return false;
}

/* Rotary settings. Transformers 4 writes `rope_theta` and `rope_scaling` (null, or an object of
 * a scaled kind); transformers 5 writes one object, `rope_parameters`, holding `rope_type` and
 * `rope_theta`. Either way only the plain kind ("default") is what fp8c's rope computes. */
static bool cfg_rope_object(const Source *s, const char *key, double theta, bool *has_theta) {
    const Jv *v = rt_json_get(&s->config, key);
    if (!v || v->kind == JV_NULL) return true;
    if (v->kind != JV_OBJ) {
        rt_error("%s: %s is not an object", s->config_path, key);
        return false;
    }
    const Jv *type = rt_json_get(v, "rope_type");
    if (!type) type = rt_json_get(v, "type");
    if (type && !(type->kind == JV_STR && strcmp(type->str, "default") == 0)) {
        rt_error("%s: %s.rope_type is %s%s%s: fp8c's rope has no scaling (\"default\" only)",
                 s->config_path, key, type->kind == JV_STR ? "\"" : "",
                 type->kind == JV_STR ? type->str : "not a string", type->kind == JV_STR ? "\"" : "");
        return false;
    }
    const Jv *t = rt_json_get(v, "rope_theta");
    if (t && t->kind != JV_NULL) {
        if (t->kind != JV_NUM) {
            rt_error("%s: %s.rope_theta is not a number", s->config_path, key);
            return false;
        }
        if (!(fabs(t->num - theta) <= 1e-6 * fabs(theta))) {
            rt_error("%s: %s.rope_theta is %g, the model's rope theta is %g", s->config_path, key,
                     t->num, theta);
            return false;
        }
        *has_theta = true;
    }
    return true;
}

static bool cfg_rope(const Source *s, double theta) {
    bool has_theta = false;
    if (!cfg_rope_object(s, "rope_parameters", theta, &has_theta) ||
        !cfg_rope_object(s, "rope_scaling", theta, &has_theta))
        return false;
    const Jv *top = rt_json_get(&s->config, "rope_theta");
    if (has_theta && (!top || top->kind == JV_NULL)) return true;
    return cfg_real(s, "rope_theta", theta, 10000.0, "rope theta");
}

/* The config against what the graph computes. */
static bool src_check_config(const Source *s, const ModelInfo *m) {
    if (s->config.kind != JV_OBJ) return true;
    if (m->family == FAM_GPT2) {
        static const char *const gelu[] = {"gelu_new", "gelu_pytorch_tanh", "gelu_fast", NULL};
        return cfg_int(s, "n_head", m->heads, "heads", "heads") &&
               cfg_int(s, "n_layer", m->layers, "layers", "layers") &&
               cfg_real(s, "layer_norm_epsilon", m->eps, 1e-5, "layernorm epsilon") &&
               cfg_str(s, "activation_function", gelu, "GELU's tanh approximation (gelu_new)") &&
               cfg_false(s, "scale_attn_by_inverse_layer_idx", "fp8c's attention does not scale by layer") &&
               cfg_false(s, "reorder_and_upcast_attn", "not supported");
    }
    static const char *const silu[] = {"silu", NULL};
    const Jv *kv = rt_json_get(&s->config, "num_key_value_heads");
    const char *kv_key = kv && kv->kind != JV_NULL ? "num_key_value_heads" : "num_attention_heads";
    return cfg_int(s, "num_attention_heads", m->heads, "heads", "heads") &&
           cfg_int(s, kv_key, m->kv_heads, "key-value heads", "kv_heads") &&
           cfg_int(s, "num_hidden_layers", m->layers, "layers", "layers") &&
           cfg_int(s, "head_dim", m->head_dim, "as its head size (dim / heads)", NULL) &&
           cfg_real(s, "rms_norm_eps", m->eps, 1e-6, "rmsnorm epsilon") &&
           cfg_rope(s, m->theta) &&
           cfg_str(s, "hidden_act", silu, "silu") &&
           cfg_false(s, "attention_bias", "fp8c's Llama has no biases") &&
           cfg_false(s, "mlp_bias", "fp8c's Llama has no biases");
}

static Family src_family(const Source *s, const char *model_type) {
    if (model_type) {
        if (strcmp(model_type, "gpt2") == 0) return FAM_GPT2;
        if (strcmp(model_type, "llama") == 0) return FAM_LLAMA;
        return FAM_NONE;
    }
    if (src_find(s, "wte.weight") || src_find(s, "transformer.wte.weight")) return FAM_GPT2;
    if (src_find(s, "model.embed_tokens.weight")) return FAM_LLAMA;
    return FAM_NONE;
}

/* Binds each parameter to the tensors its values come from. */
static bool src_bind(Source *s, const Graph *g, const ModelInfo *m) {
    s->src = calloc((size_t)g->n_nodes, sizeof *s->src);
    s->hi = calloc((size_t)g->n_nodes, sizeof *s->hi);
    s->conv = calloc((size_t)g->n_nodes, sizeof *s->conv);
    if (!s->src || !s->hi || !s->conv) {
        rt_error("out of memory");
        return false;
    }
    s->head_dim = m->head_dim;
    Problems pr = {0};
    const char *prefix = "";
    bool tied = false;
    if (!s->fp8c) {
        const Jv *mt = rt_json_get(&s->config, "model_type");
        s->family = src_family(s, mt && mt->kind == JV_STR ? mt->str : NULL);
        if (s->family == FAM_NONE) {
            if (mt && mt->kind == JV_STR)
                rt_error("%s: model_type \"%s\" is not one fp8c reads (gpt2, llama)", s->config_path,
                         mt->str);
            else
                rt_error("%s: neither GPT-2 nor Llama weights (no config.json, and no wte.weight "
                         "or model.embed_tokens.weight)", s->where);
            goto fail;
        }
        if (s->family != m->family) {
            rt_error("%s: %s weights, but this model is a %s (its parameters are named as %s's)",
                     s->where, family_names[s->family], family_names[m->family],
                     family_names[m->family]);
            goto fail;
        }
        if (!src_check_config(s, m)) goto fail;
        if (m->family == FAM_GPT2 && src_find(s, "transformer.wte.weight")) prefix = "transformer.";
        const Jv *tie = rt_json_get(&s->config, "tie_word_embeddings");
        tied = m->family == FAM_LLAMA && !src_find(s, "lm_head.weight") && tie &&
               tie->kind == JV_BOOL && tie->num;   /* LlamaConfig's default is untied */
    }
    for (int i = 0; i < g->n_nodes; i++) {
        const Node *p = g->nodes[i];
        if (p->op != OP_PARAM) continue;
        char name[1024];
        const SrcTensor *t;
        Conv c = CONV_NONE;
        if (s->fp8c) {
            /* the most precise copy: an f32 master, a split one with its bf16 high half, or
             * the weight as stored */
            snprintf(name, sizeof name, "%s:master", p->t.name);
            t = src_find(s, name);
            if (t && strcmp(t->e->dtype, "I8") == 0) s->hi[i] = src_find(s, p->t.name);
            if (s->hi[i] && s->hi[i]->e->end - s->hi[i]->e->begin != 2 * ir_numel(&p->t)) {
                rt_error("%s: tensor %s does not hold the %lld bf16 values of its split master",
                         s->where, p->t.name, (long long)ir_numel(&p->t));
                goto fail;
            }
            if (!t || (strcmp(t->e->dtype, "F32") != 0 && !s->hi[i])) t = src_find(s, p->t.name);
            snprintf(name, sizeof name, "%s", p->t.name);
        } else {
            c = hf_conv(m, p);
            if (c == CONV_ROPE && (m->head_dim <= 0 || m->head_dim % 2 || p->t.dims[0] % m->head_dim)) {
                rt_error("%s: cannot permute %s for rope: the model's head size is %lld", s->where,
                         p->t.name, (long long)m->head_dim);
                goto fail;
            }
            snprintf(name, sizeof name, "%s%s", prefix,
                     tied && strcmp(p->t.name, "lm_head.weight") == 0 ? "model.embed_tokens.weight"
                                                                     : p->t.name);
            t = src_find(s, name);
        }
        if (!t) {
            problem(&pr, PROB_MISSING, name, NULL);
            continue;
        }
        ((SrcTensor *)t)->used = true;
        if (s->hi[i]) ((SrcTensor *)s->hi[i])->used = true;
        int64_t want[IR_MAX_RANK];
        memcpy(want, p->t.dims, sizeof want);
        if (c == CONV_TRANSPOSE) want[0] = p->t.dims[1], want[1] = p->t.dims[0];
        bool same = t->e->rank == p->t.rank;
        for (int d = 0; same && d < p->t.rank; d++) same = t->e->dims[d] == want[d];
        if (!same) {
            char a[128], b[128];
            shape_text(a, sizeof a, t->e->rank, t->e->dims);
            shape_text(b, sizeof b, p->t.rank, want);
            bool rows_only = t->e->rank == 2 && p->t.rank == 2 && t->e->dims[1] == want[1];
            bool vocab = rows_only && p->t.dims[0] == m->vocab &&
                         (strcmp(p->t.name, "wte.weight") == 0 ||
                          strcmp(p->t.name, "model.embed_tokens.weight") == 0 ||
                          strcmp(p->t.name, "lm_head.weight") == 0);
            char hint[64] = "";
            if (vocab) snprintf(hint, sizeof hint, " (build with -D vocab=%lld)", (long long)t->e->dims[0]);
            char detail[400];
            snprintf(detail, sizeof detail, " is %s, the model needs %s%s", a, b, hint);
            problem(&pr, PROB_SHAPE, name, detail);
            continue;
        }
        const char *dt = t->e->dtype;
        if (s->hi[i] ? strcmp(s->hi[i]->e->dtype, "BF16") != 0
                     : strcmp(dt, "F32") && strcmp(dt, "F16") && strcmp(dt, "BF16") && strcmp(dt, "F64")) {
            rt_error("%s: tensor %s is %s: weights are read from F32, F16, BF16 or F64%s", s->where,
                     name, s->hi[i] ? s->hi[i]->e->dtype : dt,
                     s->fp8c ? " (or an F32 or split master copy)" : "");
            goto fail;
        }
        s->src[i] = t;
        s->conv[i] = c;
    }
    /* fp8c: what a run trains is what has a first moment (AdamW's adam_m, Lion's or SGD's
     * momentum); HF: every tensor but known buffers */
    for (int k = 0; k < s->n; k++) {
        const SrcTensor *t = &s->ts[k];
        if (t->used) continue;
        if (s->fp8c) {
            const char *suffix = hf_ends_with(t->name, ":adam_m") ? ":adam_m"
                                 : hf_ends_with(t->name, ":momentum") ? ":momentum" : NULL;
            if (!suffix) continue;
            char base[1024];
            snprintf(base, sizeof base, "%.*s", (int)(strlen(t->name) - strlen(suffix)), t->name);
            if (!hf_param(g, base)) problem(&pr, PROB_EXTRA, base, NULL);
        } else if (!hf_ignored(s->family, t->name) &&
                   !(tied && strcmp(t->name, "model.embed_tokens.weight") == 0)) {
            problem(&pr, PROB_EXTRA, t->name, NULL);
        }
    }
    bool ok = problems_report(&pr, s->where, g->model_name ? g->model_name : "?");
    problems_free(&pr);
    return ok;
fail:
    problems_free(&pr);
    return false;
}

/* ---------------------------------------------------------------- values */

/* One stored tensor as f32; false after rt_error. */
static bool src_read_f32(const SrcTensor *t, float *x, int64_t n) {
    const char *dt = t->e->dtype;
    int size = rt_st_dtype_bytes(dt);
    void *raw = malloc((size_t)(n ? n : 1) * (size_t)size);
    if (!raw) {
        rt_error("%s: out of memory reading tensor %s", t->file->path, t->name);
        return false;
    }
    if (!rt_st_read(t->file, t->e, raw)) {
        free(raw);
        return false;
    }
    const uint8_t *b = raw;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *q = b + i * size;
        if (size == 4) {
            uint32_t u = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
            memcpy(&x[i], &u, 4);
        } else if (size == 8) {
            uint64_t u = 0;
            for (int k = 7; k >= 0; k--) u = u << 8 | q[k];
            double d;
            memcpy(&d, &u, 8);
            x[i] = (float)d;
        } else {
            uint16_t h = (uint16_t)(q[0] | q[1] << 8);
            x[i] = strcmp(dt, "BF16") == 0 ? num_bf16_to_f32(h) : num_f16_to_f32(h);
        }
        if (!isfinite(x[i])) {
            rt_error("%s: tensor %s holds %s at element %lld", t->file->path, t->name,
                     isnan(x[i]) ? "NaN" : "an infinity", (long long)i);
            free(raw);
            return false;
        }
    }
    free(raw);
    return true;
}

static bool src_values(void *ctx, const Node *p, float *x, int64_t n) {
    Source *s = ctx;
    const SrcTensor *t = s->src[p->index];
    if (s->hi[p->index]) {   /* a split master: the bf16 weight plus its i8 correction */
        uint16_t *hi = malloc((size_t)n * sizeof *hi + 1);
        int8_t *lo = malloc((size_t)n + 1);
        bool ok = hi && lo && rt_st_read(s->hi[p->index]->file, s->hi[p->index]->e, hi) &&
                  rt_st_read(t->file, t->e, lo);
        if (ok) codec_split_decode(hi, lo, x, n);
        free(hi);
        free(lo);
        return ok;
    }
    if (s->conv[p->index] == CONV_NONE) return src_read_f32(t, x, n);
    float *y = malloc((size_t)n * sizeof *y + 1);
    bool ok = y && src_read_f32(t, y, n);
    if (ok) hf_convert(s->conv[p->index], &p->t, s->head_dim, y, x, false);
    free(y);
    return ok;
}

bool rt_init_load(Graph *g, const char *path, uint64_t seed) {
    ir_renumber(g);
    ModelInfo m;
    memset(&m, 0, sizeof m);
    Source s;
    if (!src_open(&s, path)) {
        src_free(&s);
        return false;
    }
    /* an fp8c checkpoint fits any model by name; Hugging Face weights need the family */
    bool ok = (s.fp8c || hf_model_info(g, &m)) && src_bind(&s, g, &m) &&
              rt_init_params_from(g, seed, src_values, &s);
    if (ok)
        rt_note("initialized from %s (%s)", path,
                s.fp8c ? "the weights of an fp8c checkpoint" : s.family == FAM_GPT2
                       ? "Hugging Face GPT-2 weights" : "Hugging Face Llama weights");
    src_free(&s);
    return ok;
}

/* ---------------------------------------------------------------- export */

/* A parameter's most precise value: its f32 master, its split master decoded, or itself. */
static float *hf_param_values(const Graph *g, const Node *p) {
    int64_t n = ir_numel(&p->t);
    for (int k = 0; k < g->n_nodes; k++) {
        const Node *s = g->nodes[k];
        if (s->op != OP_STATE || s->t.role != ROLE_MASTER || s->grad_of != p) continue;
        if (s->t.fmt.codec == CODEC_SPLIT) {
            float *x = malloc((size_t)n * sizeof *x + 1);
            if (x) codec_split_decode(p->t.data, s->t.data, x, n);
            return x;
        }
        return ref_load(&s->t);
    }
    return ref_load(&p->t);
}

static bool hf_write_text(const char *path, const char *text) {
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    bool ok = f && fputs(text, f) >= 0 && fflush(f) == 0 && fsync(fileno(f)) == 0;
    if (f && fclose(f) != 0) ok = false;
    if (ok && rename(tmp, path) != 0) ok = false;
    if (!ok) {
        rt_error("%s: cannot write: %s", path, strerror(errno));
        unlink(tmp);
    }
    return ok;
}

static void hf_config_text(const Graph *g, const ModelInfo *m, char *buf, size_t n) {
    if (m->family == FAM_GPT2) {
        snprintf(buf, n,
                 "{\n"
                 "  \"architectures\": [\"GPT2LMHeadModel\"],\n"
                 "  \"model_type\": \"gpt2\",\n"
                 "  \"vocab_size\": %lld,\n"
                 "  \"n_positions\": %lld,\n"
                 "  \"n_ctx\": %lld,\n"
                 "  \"n_embd\": %lld,\n"
                 "  \"n_layer\": %lld,\n"
                 "  \"n_head\": %lld,\n"
                 "  \"n_inner\": %lld,\n"
                 "  \"activation_function\": \"gelu_new\",\n"
                 "  \"layer_norm_epsilon\": %.9g,\n"
                 "  \"resid_pdrop\": 0.0,\n"
                 "  \"embd_pdrop\": 0.0,\n"
                 "  \"attn_pdrop\": 0.0,\n"
                 "  \"tie_word_embeddings\": true,\n"
                 "  \"torch_dtype\": \"float32\"\n"
                 "}\n",
                 (long long)m->vocab, (long long)m->max_seq, (long long)m->max_seq,
                 (long long)m->dim, (long long)m->layers, (long long)m->heads,
                 (long long)m->hidden, m->eps);
        return;
    }
    snprintf(buf, n,
             "{\n"
             "  \"architectures\": [\"LlamaForCausalLM\"],\n"
             "  \"model_type\": \"llama\",\n"
             "  \"vocab_size\": %lld,\n"
             "  \"hidden_size\": %lld,\n"
             "  \"intermediate_size\": %lld,\n"
             "  \"num_hidden_layers\": %lld,\n"
             "  \"num_attention_heads\": %lld,\n"
             "  \"num_key_value_heads\": %lld,\n"
             "  \"head_dim\": %lld,\n"
             "  \"hidden_act\": \"silu\",\n"
             "  \"max_position_embeddings\": %lld,\n"
             "  \"rms_norm_eps\": %.9g,\n"
             "  \"rope_theta\": %.9g,\n"
             "  \"rope_scaling\": null,\n"
             "  \"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": %.9g},\n"
             "  \"attention_bias\": false,\n"
             "  \"mlp_bias\": false,\n"
             "  \"tie_word_embeddings\": false,\n"
             "  \"torch_dtype\": \"float32\"\n"
             "}\n",
             (long long)m->vocab, (long long)m->dim, (long long)m->hidden, (long long)m->layers,
             (long long)m->heads, (long long)m->kv_heads, (long long)m->head_dim,
             (long long)(g->seq > 0 ? g->seq : 2048), m->eps, m->theta, m->theta);
}

/* The export's tensors, made one at a time as the file is written: a model is never held
 * twice in f32. */
typedef struct {
    const Graph *g;
    const ModelInfo *m;
    const Node **params;
} Export;

static bool export_fill(void *ctx, int i, void *buf) {
    Export *e = ctx;
    const Node *p = e->params[i];
    float *x = hf_param_values(e->g, p);
    if (!x) {
        rt_error("out of memory exporting %s", p->t.name);
        return false;
    }
    hf_convert(hf_conv(e->m, p), &p->t, e->m->head_dim, x, buf, true);
    free(x);
    return true;
}

bool rt_export_hf(Graph *g, const char *dir, bool overwrite) {
    ModelInfo m;
    if (!hf_model_info(g, &m)) return false;
    char st_path[4200], cfg_path[4200], index_path[4200];
    snprintf(st_path, sizeof st_path, "%s/model.safetensors", dir);
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", dir);
    /* a sharded model's index is a model too, and the one --init would read before the export
     * (hf_resolve): left beside it, it would keep the old weights the model of DIR */
    snprintf(index_path, sizeof index_path, "%s/model.safetensors.index.json", dir);
    const char *held = hf_exists(st_path) ? "model.safetensors"
                     : hf_exists(index_path) ? "model.safetensors.index.json"
                     : hf_exists(cfg_path) ? "config.json" : NULL;
    if (!overwrite && held) {
        rt_error("%s: holds a model already (%s): give --overwrite to replace it", dir, held);
        return false;
    }
    int removed = 0;
    if (!rt_ckpt_open_dir(dir, &removed)) return false;
    Tensor *ts = calloc((size_t)g->n_nodes + 1, sizeof *ts);
    Tensor **list = calloc((size_t)g->n_nodes + 1, sizeof *list);
    const Node **params = calloc((size_t)g->n_nodes + 1, sizeof *params);
    bool ok = ts && list && params;
    if (!ok) rt_error("out of memory");
    int k = 0;
    for (int i = 0; ok && i < g->n_nodes; i++) {
        const Node *p = g->nodes[i];
        if (p->op != OP_PARAM) continue;
        if (m.family == FAM_GPT2 && strcmp(p->t.name, "lm_head.weight") == 0) continue;
        Tensor *t = &ts[k];
        t->name = m.family == FAM_GPT2 ? arena_printf(g->arena, "transformer.%s", p->t.name)
                                       : p->t.name;
        t->rank = p->t.rank;
        memcpy(t->dims, p->t.dims, sizeof t->dims);
        if (hf_conv(&m, p) == CONV_TRANSPOSE) t->dims[0] = p->t.dims[1], t->dims[1] = p->t.dims[0];
        t->fmt = fmt_plain(FMT_F32);
        params[k] = p;
        list[k++] = t;
    }
    Export e = {.g = g, .m = &m, .params = params};
    CkptMeta meta = {"format", "pt"};   /* what transformers checks before loading the file */
    ok = ok && rt_ckpt_save_filled(st_path, list, k, &meta, 1, export_fill, &e);
    free(ts);
    free(list);
    free(params);
    char cfg[4096];
    hf_config_text(g, &m, cfg, sizeof cfg);
    ok = ok && hf_write_text(cfg_path, cfg);
    if (ok && hf_exists(index_path)) {   /* --overwrite: the sharded model is replaced */
        ok = unlink(index_path) == 0;
        if (!ok) rt_error("%s: cannot remove the replaced model's index: %s", index_path, strerror(errno));
        else rt_note("%s: removed the index of the sharded model replaced (its shards are kept)", index_path);
    }
    if (ok) rt_note("wrote %s and %s (%s, %d tensors, f32)", st_path, cfg_path,
                    m.family == FAM_GPT2 ? "GPT2LMHeadModel" : "LlamaForCausalLM", k);
    return ok;
}
