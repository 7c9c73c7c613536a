/* print.c — the textual IR.
 *
 * Every graph can be written as text and read back (read.c) into the same graph, so passes get
 * golden-file tests, `--print-ir-after` shows what a pass did, and the training binary embeds
 * the final plan as this text. One node a line:
 *
 *   %7 = matmul(%5, %6) trans_b=1 : bf16[8,64,768] role=activation phase=forward @"gpt2.model":21:9
 *
 * then, only where they are not the defaults: a format block fmt{scaling=... scale=%12}, the
 * format a saved value's backward copy should have (saved_as=e4m3 saved_fmt{...}), the
 * tensor name, the parameter a state belongs to (of=%3), and the memory plan (mem=offset+bytes).
 * Floats are printed with enough digits to round-trip exactly. */
#include "ir.h"

#include <string.h>

static void print_quoted(const char *s, FILE *out)
{
    fputc('"', out);
    for (; *s; s++) {
        if (*s == '"' || *s == '\\') fputc('\\', out);
        fputc(*s, out);
    }
    fputc('"', out);
}

static bool format_is_plain(const Format *f)
{
    return f->scaling == SCALE_NONE && f->recipe == RECIPE_NONE && f->codec == CODEC_PLAIN &&
           !f->scale && !f->amax && !f->group;
}

void ir_print_format(const char *key, const Format *f, FILE *out)
{
    if (format_is_plain(f)) return;
    fprintf(out, " %s{", key);
    const char *sep = "";
    if (f->scaling != SCALE_NONE) { fprintf(out, "%sscaling=%s", sep, fmt_scaling_name(f->scaling)); sep = " "; }
    if (f->group) { fprintf(out, "%sgroup=%d", sep, f->group); sep = " "; }
    if (f->recipe != RECIPE_NONE) { fprintf(out, "%srecipe=%s", sep, fmt_recipe_name(f->recipe)); sep = " "; }
    if (f->recipe == RECIPE_DELAYED) {
        fprintf(out, "%shistory=%d margin=%d history_max=%d", sep, f->history, f->margin, f->history_max);
        sep = " ";
    }
    if (f->recipe == RECIPE_STATIC) { fprintf(out, "%sstatic_scale=%.9g", sep, f->static_scale); sep = " "; }
    if (f->codec != CODEC_PLAIN) { fprintf(out, "%scodec=%s", sep, fmt_codec_name(f->codec)); sep = " "; }
    if (f->scale) { fprintf(out, "%sscale=%%%d", sep, f->scale->id); sep = " "; }
    if (f->amax) { fprintf(out, "%samax=%%%d", sep, f->amax->id); }
    fputc('}', out);
}

void ir_print_node(const Node *n, FILE *out)
{
    const OpInfo *info = ir_op_info(n->op);
    fprintf(out, "%%%d = %s(", n->id, info->text);
    for (int i = 0; i < n->n_in; i++) fprintf(out, i ? ", %%%d" : "%%%d", n->in[i]->id);
    fputc(')', out);
    for (int i = 0; i < info->n_iattr; i++)
        if (n->iattr[i]) fprintf(out, " %s=%lld", info->iattr_names[i], (long long)n->iattr[i]);
    for (int i = 0; i < info->n_fattr; i++)
        if (n->fattr[i] != 0) fprintf(out, " %s=%.17g", info->fattr_names[i], n->fattr[i]);
    fprintf(out, " : %s[", fmt_elem_name(n->t.fmt.elem));
    for (int i = 0; i < n->t.rank; i++) fprintf(out, i ? ",%lld" : "%lld", (long long)n->t.dims[i]);
    fputc(']', out);
    ir_print_format("fmt", &n->t.fmt, out);
    if (n->t.saved_as.elem != FMT_VOID) {
        fprintf(out, " saved_as=%s", fmt_elem_name(n->t.saved_as.elem));
        ir_print_format("saved_fmt", &n->t.saved_as, out);
    }
    fprintf(out, " role=%s phase=%s", ir_role_name(n->t.role), ir_phase_name(n->phase));
    if (n->t.name) {
        fputs(" name=", out);
        print_quoted(n->t.name, out);
    }
    if (n->grad_of) fprintf(out, " of=%%%d", n->grad_of->id);
    if (n->t.offset >= 0) fprintf(out, " mem=%lld+%lld", (long long)n->t.offset, (long long)n->t.bytes);
    if (n->loc.file && n->loc.line > 0) {
        fputs(" @", out);
        print_quoted(n->loc.file, out);
        fprintf(out, ":%d:%d", n->loc.line, n->loc.col);
    }
    fputc('\n', out);
}

void ir_print(const Graph *g, FILE *out)
{
    fputs("# fp8c ir\ngraph ", out);
    print_quoted(g->model_name ? g->model_name : "", out);
    fprintf(out, " batch=%lld seq=%lld opt=%d persistent=%lld transient=%lld\n", (long long)g->batch,
            (long long)g->seq, g->opt_level, (long long)g->persistent_bytes,
            (long long)g->transient_bytes);
    if (g->optim.present) {
        fprintf(out, "optim lr=%.17g beta1=%.17g beta2=%.17g eps=%.17g weight_decay=%.17g clip=%.17g",
                g->optim.lr, g->optim.beta1, g->optim.beta2, g->optim.eps, g->optim.weight_decay,
                g->optim.clip);
        /* AdamW's line is the one older texts have; the others name themselves */
        if (g->optim.kind != OPTIM_ADAMW)
            fprintf(out, " kind=%s momentum=%.17g nesterov=%d", ir_optim_name(g->optim.kind),
                    g->optim.momentum, g->optim.nesterov);
        fputc('\n', out);
    }
    for (int i = 0; i < g->n_choices; i++)
        fprintf(out, "choice %s %s\n", g->choices[i].name, g->choices[i].value);
    for (int i = 0; i < g->n_nodes; i++) ir_print_node(g->nodes[i], out);
}
