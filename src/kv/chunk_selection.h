// ShadowKV's chunk machinery for one KV head: landmarks, outlier chunks, scoring, top-k, slots.
//
// Keys here are one KV head's post-RoPE keys: row t at keys + t * row_stride, head_dim floats.
// Chunk c holds rows [c * chunk_size, (c + 1) * chunk_size).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace shadowkv::kv {

// Landmark of each chunk: the mean of its keys. landmarks: [num_chunks, head_dim].
void ComputeLandmarks(const float* keys, int64_t row_stride, int64_t num_chunks, int chunk_size,
                      int head_dim, float* landmarks);

// Per chunk, the smallest cosine similarity between its landmark and one of its keys
// (min_cosine: [num_chunks]). A zero vector counts as cosine 0.
void ChunkMinCosine(const float* keys, int64_t row_stride, const float* landmarks,
                    int64_t num_chunks, int chunk_size, int head_dim, float* min_cosine);

// O per KV head: `configured` if >= 0, else 24 per 1024 budget tokens (at least 1 when there are
// chunks); never more than `num_chunks`.
int64_t ResolveOutlierChunks(int64_t configured, int64_t budget_tokens, int64_t num_chunks);

// The `count` chunks with the lowest min-cosine (ties: lower index first), in increasing index.
std::vector<int32_t> PickOutlierChunks(std::span<const float> min_cosine, int64_t count);

// Reusable buffers for ScoreLandmarks (so decode steps do not allocate).
struct ScoreScratch {
  std::vector<float> logits;  // [query rows, num_landmarks]
  std::vector<float> sums;    // [group_size, num_landmarks]
};

// Chunk scores of one KV head: for each of its `group_size` query heads, softmax over landmarks
// of q·L/√head_dim, summed over the `num_queries` queries; then the max over the group.
// Query head g of query i is at queries + i * query_stride + g * head_dim.
// landmarks: [num_landmarks, head_dim]; scores: [num_landmarks].
void ScoreLandmarks(const float* queries, int num_queries, int64_t query_stride, int group_size,
                    const float* landmarks, int64_t num_landmarks, int head_dim,
                    ScoreScratch* scratch, float* scores);

// ScoreLandmarks before the max over the group: head_scores [group_size, num_landmarks], row g
// the softmax sums of query head g. ScoreLandmarks is the column-wise max of these rows.
void ScoreLandmarksPerHead(const float* queries, int num_queries, int64_t query_stride,
                           int group_size, const float* landmarks, int64_t num_landmarks,
                           int head_dim, ScoreScratch* scratch, float* head_scores);

// Exact scores of `num_chunks` candidate chunks of one KV head (selection "rerank"), in
// ScoreLandmarks's form with the chunks' own keys in place of their landmarks: for each query
// head g of the group, softmax over all num_chunks * chunk_size candidate TOKENS of q·k/√head_dim,
// summed over the queries; chunk c's score for head g is the sum over its tokens; its score is
// the max over the group. keys: [num_chunks * chunk_size, head_dim] (chunk c's rows together);
// scores: [num_chunks]. Queries as for ScoreLandmarks.
void ScoreChunksExact(const float* queries, int num_queries, int64_t query_stride, int group_size,
                      const float* keys, int64_t num_chunks, int chunk_size, int head_dim,
                      ScoreScratch* scratch, float* scores);

// Indices of the k highest scores (ties: lower index first), in increasing index order.
// `values` is scratch; `selected` receives min(k, scores.size()) indices.
void SelectTopK(std::span<const float> scores, int64_t k, std::vector<float>* values,
                std::vector<int32_t>* selected);

// Like SelectTopK, but each chosen chunk brings the chunk after it along: the top k of
// shifted scores s'[i] = max(s[i], s[i-1]) where item i-1 holds the chunk just before item i's
// (chunk_ids[i-1] == chunk_ids[i] - 1; an outlier in between breaks the pair, and is attended
// anyway). Taking leaders in decreasing score, each followed by its successor, until k are
// chosen gives the same set except at exactly equal scores. A needle or answer that crosses a
// chunk boundary then keeps its continuation. `shifted` and `values` are scratch.
void SelectTopKWithSuccessors(std::span<const float> scores, std::span<const int32_t> chunk_ids,
                              int64_t k, std::vector<float>* shifted, std::vector<float>* values,
                              std::vector<int32_t>* selected);

// Selection "heads": each query head of the group ranks the chunks by its own scores
// (head_scores [group_size, num_items], as ScoreLandmarksPerHead gives; within a head, higher
// score first, ties lower index first). Rounds go over the heads in order 0..group_size-1, each
// head taking its best chunk not taken yet, until min(k, num_items) distinct chunks are taken
// (the last round may stop part-way). `selected` receives them in increasing index order;
// `order` is scratch.
void SelectRoundRobinOverHeads(std::span<const float> head_scores, int group_size,
                               int64_t num_items, int64_t k, std::vector<int32_t>* order,
                               std::vector<int32_t>* selected);

// Chunks a "mass" selection may take around a budget of k chunks: at least max(1, k / 4)
// (rounded down), at most 2 k; neither above num_items.
struct MassBounds {
  int64_t floor = 0;
  int64_t cap = 0;
};
MassBounds MassSelectionBounds(int64_t k, int64_t num_items);

// Selection "mass": chunks in decreasing score (ties lower index first) until their share of the
// total score reaches `mass` — in fp64, the first n whose running sum is >= mass * total (the
// scores normalised to sum 1, without a division per chunk) — the count n then clamped to
// [bounds.floor, bounds.cap]. A total that is not positive and finite takes the floor. `selected`
// receives the chunks in increasing index order; `order` is scratch.
void SelectByMass(std::span<const float> scores, double mass, MassBounds bounds,
                  std::vector<int32_t>* order, std::vector<int32_t>* selected);

// Which item (landmark index) each gather-buffer slot holds, so that a chunk selected at two
// consecutive steps is reused in place instead of being rebuilt and fetched again.
class GatherSlots {
 public:
  struct Fill {
    int32_t slot;
    int32_t item;
  };

  // Sets the number of slots and the item range [0, num_items). Existing assignments survive;
  // new slots start empty. Neither count may shrink.
  void Resize(int32_t num_slots, int64_t num_items);

  // Places `selected` (distinct items, at most num_slots) into slots: an item already held stays
  // put (a hit); the others go to slots whose item is not selected (filled into `misses`, which
  // is cleared first). Returns the number of hits.
  int64_t Assign(std::span<const int32_t> selected, std::vector<Fill>* misses);

  int32_t num_slots() const { return static_cast<int32_t>(slot_item_.size()); }
  int32_t item_in_slot(int32_t slot) const { return slot_item_[slot]; }  // -1: empty
  int32_t slot_of_item(int32_t item) const { return item_slot_[item]; }  // -1: not held

 private:
  std::vector<int32_t> slot_item_;  // [num_slots]
  std::vector<int32_t> item_slot_;  // [num_items]
  std::vector<uint8_t> wanted_;     // [num_items] scratch for Assign
  std::vector<int32_t> free_;       // scratch for Assign
};

}  // namespace shadowkv::kv
