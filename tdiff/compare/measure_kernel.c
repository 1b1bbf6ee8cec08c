/* One pass over a piece of two tensors of one float dtype, compared bitwise: every metric of
 * tdiff.compare.metrics' bitwise rule, computed as its numpy path computes them (values in float32,
 * |a-b| and |a-b| / max(|a|, |b|) in float32; sums in float64), without the GIL, so that threads
 * measuring pieces at once are not held up between numpy calls (issue 32).
 *
 * Only finite values: where either side holds a NaN or an infinity, or a difference passes
 * float32's max, it returns 1 and the caller measures the piece with numpy, which has the rules
 * for those. Built by scripts/setup.sh; without it tdiff measures every piece with numpy. */

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t mismatched;      /* elements whose bits differ */
    int64_t worst_index;     /* the first largest |a-b| among them, else the first of them; -1: none */
    int64_t max_ulp;         /* largest distance in the ordering of the dtype's values */
    double sum_abs;          /* sum of |a-b| */
    double square_a, square_b, square_diff;   /* sums of a^2, b^2, |a-b|^2 */
    float max_abs, max_rel, magnitude;        /* magnitude: max(|a|, |b|) over the piece */
    float worst_a, worst_b;
} tdiff_piece;

enum { BFLOAT16 = 0, FLOAT32 = 1 };

/* the value's place in the ordering -inf < ... < -0 < +0 < ... < +inf */
static inline int64_t ordered(int64_t bits, int64_t magnitude_mask) {
    return bits < 0 ? -(bits & magnitude_mask) - 1 : bits;
}

#define LANES 8   /* independent partial sums and maxima: the loop is not bound by one chain of adds */
#define MAX(x, y) ((x) > (y) ? (x) : (y))   /* fmaxf is a call where NaN rules stand (no NaN gets here) */

/* element i's bit patterns as float32 bits and as signed integers of the dtype's width */
static inline void load(const void *data, int kind, int64_t i, uint32_t *bits, int64_t *signed_bits) {
    if (kind == BFLOAT16) {
        uint16_t value = ((const uint16_t *)data)[i];
        *bits = (uint32_t)value << 16;
        *signed_bits = (int16_t)value;
    } else {
        uint32_t value = ((const uint32_t *)data)[i];
        *bits = value;
        *signed_bits = (int32_t)value;
    }
}

typedef struct {
    double sum_abs[LANES], square_a[LANES], square_b[LANES], square_diff[LANES];
    float max_abs[LANES], max_rel[LANES], magnitude[LANES];
    int64_t mismatched[LANES], max_ulp[LANES];
    uint32_t not_finite[LANES];
} lanes;

static inline void add(lanes *restrict l, int lane, uint32_t ua, uint32_t ub, int64_t sa, int64_t sb, int64_t mask) {
    l->not_finite[lane] |= ((ua & 0x7F800000u) == 0x7F800000u) | ((ub & 0x7F800000u) == 0x7F800000u);
    float fa, fb;
    memcpy(&fa, &ua, 4);
    memcpy(&fb, &ub, 4);
    float diff = fabsf(fa - fb);
    float scale = MAX(fabsf(fa), fabsf(fb));
    l->magnitude[lane] = MAX(l->magnitude[lane], scale);
    l->square_a[lane] += (double)fa * fa;
    l->square_b[lane] += (double)fb * fb;
    l->square_diff[lane] += (double)diff * diff;
    l->sum_abs[lane] += diff;
    l->max_abs[lane] = MAX(l->max_abs[lane], diff);
    float relative = diff / MAX(scale, FLT_MIN);
    l->max_rel[lane] = MAX(l->max_rel[lane], relative);
    l->mismatched[lane] += ua != ub;
    int64_t ulp = ordered(sa, mask) - ordered(sb, mask);
    ulp = ulp < 0 ? -ulp : ulp;
    l->max_ulp[lane] = MAX(l->max_ulp[lane], ulp);
}

/* the first pass, for one dtype (a constant once inlined: the loop has no branch on it) */
static inline void first_pass(const void *restrict a, const void *restrict b, int64_t n, int kind, lanes *restrict l) {
    const int64_t mask = kind == BFLOAT16 ? 0x7FFF : 0x7FFFFFFF;
    uint32_t ua, ub;
    int64_t sa, sb;
    int64_t whole = n - n % LANES;
    for (int64_t base = 0; base < whole; base += LANES) {
        for (int lane = 0; lane < LANES; lane++) {
            load(a, kind, base + lane, &ua, &sa);
            load(b, kind, base + lane, &ub, &sb);
            add(l, lane, ua, ub, sa, sb, mask);
        }
    }
    for (int64_t i = whole; i < n; i++) {
        load(a, kind, i, &ua, &sa);
        load(b, kind, i, &ub, &sb);
        add(l, (int)(i - whole), ua, ub, sa, sb, mask);
    }
}

int tdiff_measure_bitwise(const void *a, const void *b, int64_t n, int kind, uint8_t *rows, int64_t width,
                          int64_t offset, tdiff_piece *out) {
    lanes l;
    memset(&l, 0, sizeof l);
    if (kind == BFLOAT16)
        first_pass(a, b, n, BFLOAT16, &l);
    else
        first_pass(a, b, n, FLOAT32, &l);
    tdiff_piece piece = {0};
    uint32_t not_finite = 0;
    for (int lane = 0; lane < LANES; lane++) {
        not_finite |= l.not_finite[lane];
        piece.mismatched += l.mismatched[lane];
        piece.sum_abs += l.sum_abs[lane];
        piece.square_a += l.square_a[lane];
        piece.square_b += l.square_b[lane];
        piece.square_diff += l.square_diff[lane];
        piece.max_abs = MAX(piece.max_abs, l.max_abs[lane]);
        piece.max_rel = MAX(piece.max_rel, l.max_rel[lane]);
        piece.magnitude = MAX(piece.magnitude, l.magnitude[lane]);
        piece.max_ulp = MAX(piece.max_ulp, l.max_ulp[lane]);
    }
    if (not_finite || isinf(piece.max_abs))
        return 1;   /* NaN or an infinity, or a difference past float32's max (numpy's path takes it to float64) */
    piece.worst_index = -1;
    if (piece.mismatched) {
        /* where the worst element is: the first largest |a-b|, else (only signed zeros differ) the
         * first that differs */
        uint32_t ua, ub;
        int64_t sa, sb;
        for (int64_t i = 0; i < n && piece.worst_index < 0; i++) {
            load(a, kind, i, &ua, &sa);
            load(b, kind, i, &ub, &sb);
            float fa, fb;
            memcpy(&fa, &ua, 4);
            memcpy(&fb, &ub, 4);
            if (ua != ub && fabsf(fa - fb) == piece.max_abs) {
                piece.worst_index = i;
                piece.worst_a = fa;
                piece.worst_b = fb;
            }
        }
        /* the rows where bits differ, a row's span of the piece at a time */
        if (rows && width) {
            const int64_t size = kind == BFLOAT16 ? 2 : 4;
            for (int64_t start = 0; start < n;) {
                int64_t row = (offset + start) / width;
                int64_t end = (row + 1) * width - offset;
                if (end > n)
                    end = n;
                if (memcmp((const char *)a + start * size, (const char *)b + start * size, (end - start) * size))
                    rows[row] = 1;
                start = end;
            }
        }
    }
    *out = piece;
    return 0;
}
