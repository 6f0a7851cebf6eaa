/*
 * The AMX intrinsics of GCC's <amxtileintrin.h>, <amxbf16intrin.h> and <amxint8intrin.h>,
 * under their names, for the emulating build (tests/c/emulate/immintrin.h includes this, as
 * GCC's <immintrin.h> includes those): an amx tier's kernel sources compile unchanged at
 * baseline x86-64 and run on the tile unit modelled in bf16_amx_model.h, which says what it
 * follows and what the silicon was found to do. A use that would fault on hardware (a bad
 * configuration, mismatched shapes) aborts with a message.
 *
 * As in GCC, a tile is named by an integer constant, 0 to 7: CM_AMX_IMM refuses anything else
 * at compile time (a bit-field's width must be a constant, and positive), so a kernel that
 * builds here also builds with the real intrinsics.
 */
#ifndef CPUMOE_TESTS_EMULATE_AMX_H
#define CPUMOE_TESTS_EMULATE_AMX_H

#include "bf16_amx_model.h"

#define CM_AMX_IMM(t) \
  ((void)sizeof(struct { unsigned tile_immediate : (t) >= 0 && (t) < 8 ? 1 : -1; }), (t))

#define _tile_loadconfig(config) cm_amx_ldtilecfg(config)
#define _tile_storeconfig(config) cm_amx_sttilecfg(config)
#define _tile_release() cm_amx_tilerelease()
#define _tile_loadd(dst, base, stride) cm_amx_tileloadd(CM_AMX_IMM(dst), base, (long)(stride))
/* tileloaddt1 differs only in its cache hint */
#define _tile_stream_loadd(dst, base, stride) \
  cm_amx_tileloadd(CM_AMX_IMM(dst), base, (long)(stride))
#define _tile_stored(src, base, stride) cm_amx_tilestored(CM_AMX_IMM(src), base, (long)(stride))
#define _tile_zero(dst) cm_amx_tilezero(CM_AMX_IMM(dst))
#define _tile_dpbf16ps(dst, src1, src2) \
  cm_amx_tdpbf16ps(CM_AMX_IMM(dst), CM_AMX_IMM(src1), CM_AMX_IMM(src2))
/* the letters say how src1's and src2's bytes extend: s signed, u unsigned */
#define _tile_dpbssd(dst, src1, src2) \
  cm_amx_tdpb(CM_AMX_IMM(dst), CM_AMX_IMM(src1), CM_AMX_IMM(src2), 1, 1)
#define _tile_dpbsud(dst, src1, src2) \
  cm_amx_tdpb(CM_AMX_IMM(dst), CM_AMX_IMM(src1), CM_AMX_IMM(src2), 1, 0)
#define _tile_dpbusd(dst, src1, src2) \
  cm_amx_tdpb(CM_AMX_IMM(dst), CM_AMX_IMM(src1), CM_AMX_IMM(src2), 0, 1)
#define _tile_dpbuud(dst, src1, src2) \
  cm_amx_tdpb(CM_AMX_IMM(dst), CM_AMX_IMM(src1), CM_AMX_IMM(src2), 0, 0)

#endif /* CPUMOE_TESTS_EMULATE_AMX_H */
