#version 450
#define DOT_INTRINSIC 1
#include "matmul_q8.glsl"
