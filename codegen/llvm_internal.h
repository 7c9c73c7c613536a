/* llvm_internal.h — what the LLVM renderer (llvm.c) and its compiler (llvm_compile.c) share:
 * the state of one rendering (R) and the two calls that make and free a module. Internal to
 * codegen/; only fp8c_llvm, the library that links LLVM, includes it. */
#ifndef FP8C_LLVM_INTERNAL_H
#define FP8C_LLVM_INTERNAL_H

#include "codegen.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <llvm-c/Analysis.h>
#include <llvm-c/Core.h>
#include <llvm-c/DebugInfo.h>
#include <llvm-c/ErrorHandling.h>
#include <llvm-c/IRReader.h>
#include <llvm-c/Target.h>
#include <llvm-c/TargetMachine.h>
#include <llvm-c/Transforms/PassBuilder.h>

#ifndef FP8C_LLVM_VERSION
#define FP8C_LLVM_VERSION "14"
#endif

enum { MAX_DEPTH = 16 };

typedef struct {
    int inst;
    LLVMBasicBlockRef header, exit;
    LLVMValueRef slot;      /* i64 induction variable */
    LLVMValueRef hi;
    bool row;
    LLVMValueRef group;     /* a row loop's access group (NULL: a sequential loop) */
} Loop;

typedef struct {
    LLVMContextRef ctx;
    LLVMModuleRef mod;
    LLVMBuilderRef b;
    LLVMTypeRef f32, f64, i64, i32, i16, i8, i1, i8p, fn_type;
    LLVMValueRef table_e4m3, table_e5m2;
    unsigned md_loop, md_access_group;
    LLVMModuleRef groups_mod;   /* holds the access groups (distinct nodes) until disposal */
    LLVMValueRef *group;        /* access groups not yet given to a loop */
    int n_groups, next_group;
    /* per function */
    const CgKernel *k;
    LLVMValueRef fn;
    LLVMValueRef *val;          /* per instruction */
    LLVMValueRef *slot;         /* per instruction: REDUCE accumulator, LOCAL array */
    int *red_loop;              /* per REDUCE instruction: its loop's instruction */
    LLVMValueRef *ptr;          /* per buffer: i8* base */
    LLVMValueRef *scale0;       /* per buffer: the per-tensor scale, hoisted; NULL otherwise */
    Loop loops[MAX_DEPTH];
    int depth;
    LLVMValueRef item_group;    /* the item loop's access group, when it is vectorized */
    LLVMValueRef groups;        /* the access groups of what is emitted now; NULL: none */
} R;

/* The program's functions and the runtime's table as one module in r (a fresh context). */
void llvm_render_module(R *r, const CgProgram *p);
/* Frees what llvm_render_module made. */
void llvm_dispose(R *r);

#endif
