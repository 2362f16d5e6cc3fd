/* Exhaustive check of kernels/src/numerics.py's div_qmax: for every positive finite FP32 amax, is
 *     q = RN(amax * c), r = fma(-q, Q, amax), RN-fma(r, c, q)      (c = RN(1 / Q))
 * the correctly rounded amax / Q?  Counts the misrounded quotients, normal and subnormal, per grid maximum Q.
 *     gcc -O2 -o /tmp/check_fast_division scripts/check_fast_division.c -lm && /tmp/check_fast_division
 * (2^31 values per Q; ~25 s each on one core).  Measured 2026-12-07 (x86-64, gcc 12, libm fmaf):
 *     Q=6     normal 0, subnormal 1398101 (the largest 0x1.55555p-128)
 *     Q=7     normal 0, subnormal 0
 *     Q=1.75  normal 2396746, subnormal 2496609
 *     Q=448   normal 0, subnormal 599186 (the largest 0x1.24924p-129)
 * so div_qmax takes 6, 7 and 448: exact at every normal quotient, and the misrounded subnormal ones (< 2^-127.5)
 * times s_enc <= 2^117 stay under 2^-10, which the E4M3 block scale rounds to 0 either way (div_qmax). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

static float from_bits(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
static uint32_t bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }

int main(void) {
    const float qs[] = {6.0f, 7.0f, 1.75f, 448.0f};
    for (int i = 0; i < 4; i++) {
        volatile float one = 1.0f;  /* no constant folding in double */
        float q_max = qs[i], c = one / q_max;
        long normal = 0, subnormal = 0;
        float largest = 0.0f;  /* the largest misrounded subnormal quotient */
        for (uint32_t b = 1; b < 0x7f800000u; b++) {
            float x = from_bits(b), q = x * c, r = fmaf(-q, q_max, x), fast = fmaf(r, c, q), ieee = x / q_max;
            if (bits(fast) != bits(ieee)) {
                if (ieee < 1.17549435e-38f) {
                    subnormal++;
                    if (ieee > largest) largest = ieee;
                } else {
                    normal++;
                }
            }
        }
        printf("Q=%g c=%a: misrounded at normal quotients %ld, at subnormal quotients %ld (the largest %a)\n",
               q_max, c, normal, subnormal, largest);
    }
    return 0;
}
