#version 450
#define DOT_INTRINSIC 0
#include "matmul_q8.glsl"
