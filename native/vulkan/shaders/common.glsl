// Shared declarations of every pyfast compute shader.
//
// Binding 0: the dispatch's parameters (vk::Params in vk_context.h). Binding 1: the tensors as
// raw 32-bit words, B[0] the output and B[1 + i] the node's source i. Each is bound at an aligned
// offset and P.ofs gives where the tensor starts inside its binding (bytes). Dims (ne) and byte
// strides (nb) are innermost first.
#extension GL_GOOGLE_include_directive : require

layout(std140, set = 0, binding = 0) uniform Params {
  ivec4 ne[9];
  ivec4 nb[9];
  uvec4 ofs[3];
  ivec4 ip[2];
  vec4 fp[2];
} P;

layout(std430, set = 0, binding = 1) buffer Buf { uint w[]; } B[9];

// dtype ids (GGUF numbering, as pyfast::DType)
const int T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8;
const int T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_I32 = 26, T_BF16 = 30;

uint tofs(int t) { return P.ofs[t >> 2][t & 3]; }
int ne(int t, int d) { return P.ne[t][d]; }
uint nb(int t, int d) { return uint(P.nb[t][d]); }
uint nelem(int t) { return uint(P.ne[t].x) * uint(P.ne[t].y) * uint(P.ne[t].z) * uint(P.ne[t].w); }

// Byte offset of element (i0 innermost, i1, i2, i3) of a non-block tensor t.
uint eoff(int t, uint i0, uint i1, uint i2, uint i3) {
  return tofs(t) + i0 * nb(t, 0) + i1 * nb(t, 1) + i2 * nb(t, 2) + i3 * nb(t, 3);
}
// Row base (i1, i2, i3) of tensor t: for block types the row's first byte.
uint roff(int t, uint i1, uint i2, uint i3) { return tofs(t) + i1 * nb(t, 1) + i2 * nb(t, 2) + i3 * nb(t, 3); }
// Split a linear element index into (i0, i1, i2, i3) over the dims of tensor t.
uvec4 unflat(int t, uint i) {
  uvec4 r;
  r.x = i % uint(ne(t, 0)); i /= uint(ne(t, 0));
  r.y = i % uint(ne(t, 1)); i /= uint(ne(t, 1));
  r.z = i % uint(ne(t, 2)); i /= uint(ne(t, 2));
  r.w = i;
  return r;
}

uint rd32(int t, uint b) { return B[t].w[b >> 2]; }
uint rd8(int t, uint b) { return (B[t].w[b >> 2] >> ((b & 3u) * 8u)) & 0xffu; }
uint rd16(int t, uint b) { return (B[t].w[b >> 2] >> ((b & 2u) * 8u)) & 0xffffu; }
int rdi8(int t, uint b) { return int(rd8(t, b) ^ 0x80u) - 128; }
float rdf32(int t, uint b) { return uintBitsToFloat(rd32(t, b)); }
float rdf16(int t, uint b) { return unpackHalf2x16(rd16(t, b)).x; }
float rdbf16(int t, uint b) { return uintBitsToFloat(rd16(t, b) << 16); }
void wrf32(int t, uint b, float v) { B[t].w[b >> 2] = floatBitsToUint(v); }

uint gid_linear() { return gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x; }

// One float element of a non-block tensor of type ty.
float rdt(int t, int ty, uint b) {
  if (ty == T_F32) return rdf32(t, b);
  if (ty == T_F16) return rdf16(t, b);
  if (ty == T_BF16) return rdbf16(t, b);
  return float(int(rd32(t, b)));  // I32
}
