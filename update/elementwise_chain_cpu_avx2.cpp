// The AVX2 variant of the tiled loops (compiled with -mavx2 -mno-fma; chosen at run time).
#define SHAMPOO_CHAIN_VARIANT avx2
#include "update/elementwise_chain_tiles.inc"
