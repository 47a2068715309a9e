// Element decoding of GGUF block formats. rb: byte offset of the row (a whole number of blocks),
// e: element index in the row.

void k4_scale_min(int t, uint sp, uint j, out float sc, out float m) {
  if (j < 4u) {
    sc = float(rd8(t, sp + j) & 63u);
    m = float(rd8(t, sp + j + 4u) & 63u);
  } else {
    sc = float((rd8(t, sp + j + 4u) & 0xfu) | ((rd8(t, sp + j - 4u) >> 6) << 4));
    m = float((rd8(t, sp + j + 4u) >> 4) | ((rd8(t, sp + j) >> 6) << 4));
  }
}

float deq(int t, int ty, uint rb, uint e) {
  if (ty == T_F32) return rdf32(t, rb + 4u * e);
  if (ty == T_F16) return rdf16(t, rb + 2u * e);
  if (ty == T_BF16) return rdbf16(t, rb + 2u * e);
  const uint j = e & 31u;
  if (ty == T_Q8_0) {
    const uint bb = rb + (e >> 5) * 34u;
    return rdf16(t, bb) * float(rdi8(t, bb + 2u + j));
  }
  if (ty == T_Q4_0 || ty == T_Q4_1) {
    const uint bb = rb + (e >> 5) * (ty == T_Q4_0 ? 18u : 20u);
    const uint qs = bb + (ty == T_Q4_0 ? 2u : 4u);
    const uint q = j < 16u ? (rd8(t, qs + j) & 0xfu) : (rd8(t, qs + j - 16u) >> 4);
    if (ty == T_Q4_0) return rdf16(t, bb) * (float(q) - 8.0);
    return rdf16(t, bb) * float(q) + rdf16(t, bb + 2u);
  }
  if (ty == T_Q5_0 || ty == T_Q5_1) {
    const uint bb = rb + (e >> 5) * (ty == T_Q5_0 ? 22u : 24u);
    const uint hp = bb + (ty == T_Q5_0 ? 2u : 4u);
    const uint qh = rd8(t, hp) | (rd8(t, hp + 1u) << 8) | (rd8(t, hp + 2u) << 16) | (rd8(t, hp + 3u) << 24);
    const uint qs = hp + 4u;
    const uint lo = j < 16u ? (rd8(t, qs + j) & 0xfu) : (rd8(t, qs + j - 16u) >> 4);
    const uint q = lo | (((qh >> j) & 1u) << 4);
    if (ty == T_Q5_0) return rdf16(t, bb) * (float(q) - 16.0);
    return rdf16(t, bb) * float(q) + rdf16(t, bb + 2u);
  }
  const uint r = e & 255u;
  if (ty == T_Q4_K || ty == T_Q5_K) {
    const uint bb = rb + (e >> 8) * (ty == T_Q4_K ? 144u : 176u);
    const uint sb = r >> 5, l = r & 31u, pair = sb >> 1;
    float sc, m;
    k4_scale_min(t, bb + 4u, sb, sc, m);
    const uint qs = bb + (ty == T_Q4_K ? 16u : 48u);
    const uint ql = rd8(t, qs + 32u * pair + l);
    uint q = (sb & 1u) != 0u ? (ql >> 4) : (ql & 0xfu);
    if (ty == T_Q5_K) q += ((rd8(t, bb + 16u + l) >> sb) & 1u) << 4;
    return rdf16(t, bb) * sc * float(q) - rdf16(t, bb + 2u) * m;
  }
  if (ty == T_Q6_K) {
    const uint bb = rb + (e >> 8) * 210u;
    const uint half_ = r >> 7, rr = r & 127u, quarter = rr >> 5, l = rr & 31u;
    const uint qlp = bb + 64u * half_, qhp = bb + 128u + 32u * half_, scp = bb + 192u + 8u * half_;
    const uint qh = rd8(t, qhp + l);
    const uint lo = (quarter & 1u) != 0u ? rd8(t, qlp + l + 32u) : rd8(t, qlp + l);
    const uint q = ((quarter >= 2u) ? (lo >> 4) : (lo & 0xfu)) | (((qh >> (2u * quarter)) & 3u) << 4);
    const int sc = rdi8(t, scp + l / 16u + 2u * quarter);
    return rdf16(t, bb + 208u) * float(sc) * (float(q) - 32.0);
  }
  return 0.0;
}
