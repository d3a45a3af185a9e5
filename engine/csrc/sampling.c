/* The sampler's draws in one C call per step (engine/sampling_kernels.py), for float32 rows on the
 * CPU, each by inverse CDF with one uniform per row (engine/sampler.py has the method).
 *
 * Plain rows (temperature, maybe min-p): plain_draw_f32 takes the logits and does temperature,
 * softmax, min-p and the draw in one pass of exp over the row, plus a short second one. The
 * row's weights e_i = exp((x_i - max x) / T) are never stored, nor normalised: per block of 64
 * tokens it keeps their sum, finds the block where the cumulative sum reaches (1 - u) times the
 * total, and recomputes that block's 64 weights to find the token. Its exp is common.h's, within
 * 2 ulp of expf; the sums are float32 within a block and float64 across blocks. So the token is
 * drawn from the softmax to float32 rounding, as the PyTorch path's is, but for a rare u it is
 * not the same token as the PyTorch path's.
 *
 * Top-k / top-p rows: filtered_draw_f32 takes the probabilities PyTorch's softmax computed and
 * returns what engine/sampling_filters.py's top_k_top_p_sorted followed by engine/sampler.py's
 * draw return, bit for bit: the same ranking (probability descending, then token id ascending),
 * the same float64 sums taken in the same order, the same comparisons. Only the ranking is
 * cheaper. The PyTorch path ranks the 64 most likely tokens (torch.topk) and widens; here the
 * candidates are every token whose probability is at least a threshold t, which needs no
 * selection, only a pass that compares:
 *
 *   Every token outside the candidates has p < t <= every candidate's p, so in the full ranking
 *   the candidates come first, in their own ranking's order. A head that ends within the
 *   candidates (top-k's k of them are there, or top-p's mass is crossed at or before the first
 *   token outside them) is therefore the full ranking's head, with the same masses before each
 *   position. A head that would run past them is not known yet: the next, lower threshold is
 *   tried, and the last "threshold" is 0, every token.
 *
 * The thresholds are the row's largest probability over 8, 64, ... 8^LEVELS. One vectorised pass
 * counts the tokens at or above each and sums their probability, and the highest threshold whose
 * candidates are enough (at least k of them; or, with top-p alone, a mass of at least top_p times
 * the row's) is tried first. That mass is a float32 estimate; the walk over the ranked candidates
 * decides exactly, so an estimate that falls short only costs a second try (counted: the return
 * value). Real answers' heads are tens of tokens, ranked from a few dozen candidates; a flat row
 * (a model unsure of its next token) ranks most of the vocabulary, as the full sort would.
 */
#include <stdlib.h>

#include "common.h"

#define BLOCK 64 /* tokens per block of the plain draw */
#define LEVELS 6 /* thresholds max(p) / 8^1 ... max(p) / 8^LEVELS, then every token */

/* The largest of row[0 .. n), n >= 1 (no NaN). */
static float row_max(const float *row, int64_t n) {
    float largest = row[0];
    int64_t i = 0;
    if (n >= 8) {
        f32x8 lanes = load8(row);
        for (i = 8; i + 8 <= n; i += 8) {
            const f32x8 x = load8(row + i);
            lanes = select8(x > lanes, x, lanes);
        }
        for (int lane = 0; lane < 8; ++lane) largest = lanes[lane] > largest ? lanes[lane] : largest;
    }
    for (; i < n; ++i) largest = row[i] > largest ? row[i] : largest;
    return largest;
}

/* The plain draw's weights of tokens [start, start + n), n <= BLOCK, into w: exp((x - largest) *
 * inverse_temperature), 0 below min_p (the largest weight is exp(0) = 1), and 0 where the
 * exponent is below -87, where exp8 clamps (a -inf logit, a masked token, has weight 0; the
 * others dropped weigh < 2e-38 each, far below float32 rounding of the total). */
static void block_weights(const float *logits, int64_t start, int64_t n, float largest, float inverse_temperature,
                          float min_p, float w[BLOCK]) {
    const f32x8 zero = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const f32x8 x = (load8(logits + start + j) - largest) * inverse_temperature, e = exp8(x);
        store8(w + j, select8((x >= -87.0f) & (e >= min_p), e, zero));
    }
    for (; j < n; ++j) {
        const float x = (logits[start + j] - largest) * inverse_temperature, e = expf(x);
        w[j] = x >= -87.0f && e >= min_p ? e : 0.0f;
    }
}

static float block_sum(const float w[BLOCK], int64_t n) {
    f32x8 lanes = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) lanes += load8(w + j);
    float sum = sum8(lanes);
    for (; j < n; ++j) sum += w[j];
    return sum;
}

/* For each of `rows` rows of logits [rows, vocab] (float32, contiguous): the token drawn with
 * temperature temperature[r] > 0 and min-p min_p[r] (min_p NULL: none) with the uniform u[r] in
 * [0, 1), into tokens[r]: the first token whose cumulative weight reaches (1 - u) times the row's
 * total (1 - u is in (0, 1], so a zero-weight token is never picked). */
void plain_draw_f32(const float *logits, int64_t rows, int64_t vocab, const float *temperature, const float *min_p,
                    const double *u, int64_t *tokens) {
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(static) if (rows >= 4)
    for (int64_t r = 0; r < rows; ++r) {
        const float *row = logits + r * vocab;
        const float largest = row_max(row, vocab), inverse_temperature = 1.0f / temperature[r];
        const float floor = min_p ? min_p[r] : 0.0f;
        float *mass = malloc((size_t)blocks * sizeof *mass), w[BLOCK];
        if (mass == NULL) abort();
        double total = 0.0;
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t n = b + 1 < blocks ? BLOCK : vocab - b * BLOCK;
            block_weights(row, b * BLOCK, n, largest, inverse_temperature, floor, w);
            mass[b] = block_sum(w, n);
            total += mass[b];
        }
        const double goal = (1.0 - u[r]) * total;
        /* the first block whose cumulative weight reaches the goal: the same float64 sums as the
         * total's, so one does (the last with weight, at the latest), and before < goal */
        double before = 0.0;
        int64_t b = 0;
        while (b + 1 < blocks && !(mass[b] > 0.0f && before + mass[b] >= goal)) before += mass[b++];
        const int64_t n = b + 1 < blocks ? BLOCK : vocab - b * BLOCK;
        block_weights(row, b * BLOCK, n, largest, inverse_temperature, floor, w);
        int64_t pick = -1;
        double cumulative = before;
        for (int64_t j = 0; j < n && pick < 0; ++j) {
            cumulative += w[j];
            if (w[j] > 0.0f && cumulative >= goal) pick = j;
        }
        for (int64_t j = n - 1; pick < 0; --j)  /* the float32 block sum rounded past the goal: its last weighted token */
            if (w[j] > 0.0f) pick = j;
        tokens[r] = b * BLOCK + pick;
        free(mass);
    }
}

/* A candidate's rank key: ascending order of (~bits(p) << 32 | id) is p descending, then id
 * ascending (for p >= 0 a float's bits order like its value). */
static inline uint64_t rank_key(float p, int64_t id) {
    uint32_t bits;
    memcpy(&bits, &p, sizeof bits);
    return ((uint64_t)(~bits) << 32) | (uint64_t)id;
}

static inline float key_probability(uint64_t key) {
    const uint32_t bits = ~(uint32_t)(key >> 32);
    float p;
    memcpy(&p, &bits, sizeof p);
    return p;
}

static int compare_keys(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Per threshold t[l], how many of probs[0 .. vocab) are >= t[l] and their probability sum. */
static void count_levels(const float *probs, int64_t vocab, const float t[LEVELS], int64_t counts[LEVELS],
                         float masses[LEVELS]) {
    i32x8 count[LEVELS];
    f32x8 mass[LEVELS];
    const f32x8 zero = {0};
    for (int l = 0; l < LEVELS; ++l) count[l] = (i32x8){0}, mass[l] = zero;
    int64_t i = 0;
    for (; i + 8 <= vocab; i += 8) {
        const f32x8 p = load8(probs + i);
        for (int l = 0; l < LEVELS; ++l) {
            const i32x8 above = p >= t[l];  /* -1 where true */
            count[l] -= above;
            mass[l] += select8(above, p, zero);
        }
    }
    for (int l = 0; l < LEVELS; ++l) {
        counts[l] = 0;
        for (int lane = 0; lane < 8; ++lane) counts[l] += count[l][lane];
        masses[l] = sum8(mass[l]);
        for (int64_t j = i; j < vocab; ++j)
            if (probs[j] >= t[l]) counts[l] += 1, masses[l] += probs[j];
    }
}

/* keys[0 ..) <- the rank keys of the tokens with probs[i] >= threshold, in id order; eight
 * tokens at a time are skipped with one comparison when none is a candidate (most are). */
static void collect(const float *probs, int64_t vocab, float threshold, uint64_t *keys) {
    int64_t n = 0, i = 0;
    for (; i + 8 <= vocab; i += 8) {
        const i32x8 above = load8(probs + i) >= threshold;
        const i32x8 halves = __builtin_shufflevector(above, above, 4, 5, 6, 7, 0, 1, 2, 3) | above;
        if (!(halves[0] | halves[1] | halves[2] | halves[3])) continue;
        for (int64_t j = i; j < i + 8; ++j)
            if (probs[j] >= threshold) keys[n++] = rank_key(probs[j], j);
    }
    for (; i < vocab; ++i)
        if (probs[i] >= threshold) keys[n++] = rank_key(probs[i], i);
}

/* One row: the token drawn, in *token; returns 1 if the first candidate set was not enough. */
static int draw_row(const float *probs, int64_t vocab, int64_t top_k, float top_p, double row_mass, double u,
                    int first_level, int64_t *token) {
    const float largest = row_max(probs, vocab);
    float t[LEVELS];
    int64_t counts[LEVELS];
    float masses[LEVELS];
    for (int l = 0; l < LEVELS; ++l) t[l] = ldexpf(largest, -3 * (l + 1));
    count_levels(probs, vocab, t, counts, masses);
    const int has_top_k = top_k < vocab, has_top_p = top_p < 1.0f;
    /* mass before a position that ends the head (+inf without top-p: it never does) */
    double target = INFINITY;
    int level = first_level;
    if (level < 0) {
        level = 0;
        while (level < LEVELS && !(has_top_k ? counts[level] >= top_k
                                             : (double)masses[level] >= (double)top_p * row_mass))
            ++level;
    }
    for (int first = level;; ++level) {
        const int64_t count = level < LEVELS ? counts[level] : vocab;
        const float threshold = level < LEVELS ? t[level] : 0.0f;
        if (has_top_k && count < top_k && count < vocab) continue;  /* k ranks reach past the candidates */
        uint64_t *keys = malloc((size_t)count * sizeof *keys);
        if (keys == NULL) abort();
        collect(probs, vocab, threshold, keys);
        qsort(keys, (size_t)count, sizeof *keys, compare_keys);
        const int64_t k = has_top_k ? top_k : vocab;
        if (has_top_p) {
            double mass = row_mass;
            if (has_top_k) {  /* top-p measures what top-k left: the first k probabilities */
                mass = 0.0;
                for (int64_t r = 0; r < k; ++r) mass += key_probability(keys[r]);
            }
            target = (double)top_p * mass;
        }
        double before = 0.0;  /* mass of the positions before r */
        int64_t r = 0;
        while (r < count && r < k && before < target) before += key_probability(keys[r++]);
        /* the head is [0, r): known unless every candidate was kept and the head may go on */
        if (r == count && r < k && before < target && count < vocab) {
            free(keys);
            continue;
        }
        const double goal = (1.0 - u) * before;  /* the draw: the first position whose cumulative weight reaches it */
        double cumulative = 0.0;
        int64_t pick = 0;
        for (; pick < r - 1; ++pick) {
            cumulative += key_probability(keys[pick]);
            if (cumulative >= goal) break;
        }
        *token = (int64_t)(uint32_t)keys[pick];
        free(keys);
        return level > first;
    }
}

/* For each of `rows` rows of probs [rows, vocab] (float32, contiguous): the token drawn with top-k
 * top_k[r] (vocab: none) and top-p top_p[r] (1: none), against the row's total probability
 * row_mass[r] (the mass top-p measures without top-k), with the uniform u[r] in [0, 1), into
 * tokens[r]. first_level < 0 picks the first candidate threshold from the counts; 0 .. LEVELS
 * forces it (LEVELS: every token). Returns the number of rows that needed more than the first
 * candidate set. */
int64_t filtered_draw_f32(const float *probs, int64_t rows, int64_t vocab, const int64_t *top_k, const float *top_p,
                          const double *row_mass, const double *u, int first_level, int64_t *tokens) {
    int64_t widened = 0;
#pragma omp parallel for reduction(+ : widened) schedule(dynamic) if (rows >= 4)
    for (int64_t r = 0; r < rows; ++r)
        widened += draw_row(probs + r * vocab, vocab, top_k[r], top_p[r], row_mass[r], u[r], first_level, tokens + r);
    return widened;
}
