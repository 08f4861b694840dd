// An Arrow memory pool whose large buffers come from an allocator handed in (cudaHostAlloc: pinned host
// memory), so that Arrow's Parquet decoder writes a step's values straight into memory a GPU copies from
// (trajstore/device/decode_pool.py builds and loads it; benchmarks/RESULTS.md, issue 23, seventeenth round).
// Buffers of at least `threshold` bytes are taken in power-of-two sizes and kept for reuse when freed (pinned
// allocations are slow to make); smaller ones, and any the allocator refuses, come from Arrow's default pool.
// With no allocator handed in, large buffers are plain page-aligned memory, cached the same way (the pool's
// CPU tests).

#include <arrow/memory_pool.h>
#include <arrow/status.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

namespace {

typedef int (*AllocFn)(void**, size_t, unsigned int);  // cudaHostAlloc(ptr, size, flags)

int Log2Ceil(int64_t n) {
  int b = 0;
  while ((int64_t(1) << b) < n) ++b;
  return b;
}

class CachedPool : public arrow::MemoryPool {
 public:
  CachedPool(AllocFn alloc, int64_t threshold)
      : alloc_(alloc), threshold_(threshold), base_(arrow::default_memory_pool()), free_(64) {}

  arrow::Status Allocate(int64_t size, int64_t alignment, uint8_t** out) override {
    if (size < threshold_ || alignment > 4096) return base_->Allocate(size, alignment, out);
    const int b = Log2Ceil(size);
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& list = free_[b];
      if (!list.empty()) {
        *out = list.back();
        list.pop_back();
        owned_[*out] = b;
        bytes_ += size;
        ++allocations_;
        return arrow::Status::OK();
      }
    }
    void* p = nullptr;
    const size_t n = size_t(1) << b;
    int rc = alloc_ != nullptr ? alloc_(&p, n, 1 /* cudaHostAllocPortable */) : posix_memalign(&p, 4096, n);
    if (rc != 0 || p == nullptr) return base_->Allocate(size, alignment, out);
    std::lock_guard<std::mutex> g(mu_);
    owned_[static_cast<uint8_t*>(p)] = b;
    *out = static_cast<uint8_t*>(p);
    bytes_ += size;
    reserved_ += int64_t(n);
    ++made_;
    ++allocations_;
    return arrow::Status::OK();
  }

  void Free(uint8_t* buffer, int64_t size, int64_t alignment) override {
    if (size < threshold_) return base_->Free(buffer, size, alignment);  // never one of ours (see Reallocate)
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = owned_.find(buffer);
      if (it != owned_.end()) {
        free_[it->second].push_back(buffer);
        owned_.erase(it);
        bytes_ -= size;
        return;
      }
    }
    base_->Free(buffer, size, alignment);
  }

  arrow::Status Reallocate(int64_t old_size, int64_t new_size, int64_t alignment,
                           uint8_t** ptr) override {
    int b = -1;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto it = owned_.find(*ptr);
      if (it != owned_.end()) b = it->second;
      if (b >= 0 && new_size >= threshold_ && new_size <= (int64_t(1) << b)) {  // fits the buffer it has
        bytes_ += new_size - old_size;
        return arrow::Status::OK();
      }
    }
    if (b < 0 && new_size < threshold_) return base_->Reallocate(old_size, new_size, alignment, ptr);
    // (a buffer of ours shrunk below the threshold moves to the default pool: Free takes any buffer of less
    // than the threshold to be the default pool's, without a lookup)
    uint8_t* out = nullptr;
    arrow::Status st = Allocate(new_size, alignment, &out);
    if (!st.ok()) return st;
    std::memcpy(out, *ptr, size_t(old_size < new_size ? old_size : new_size));
    Free(*ptr, old_size, alignment);
    *ptr = out;
    return arrow::Status::OK();
  }

  int64_t bytes_allocated() const override { return bytes_.load() + base_->bytes_allocated(); }
  int64_t total_bytes_allocated() const override { return reserved_.load(); }
  int64_t num_allocations() const override { return allocations_.load(); }
  std::string backend_name() const override { return alloc_ != nullptr ? "pinned" : "cached"; }

  int64_t made() const { return made_.load(); }

  // Whether [p, p + n) lies inside one buffer of the pool's own that is handed out.
  bool Owns(const uint8_t* p, int64_t n) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = owned_.upper_bound(const_cast<uint8_t*>(p));
    if (it == owned_.begin()) return false;
    --it;
    return p + n <= it->first + (int64_t(1) << it->second);
  }
  int64_t reserved() const { return reserved_.load(); }

 private:
  AllocFn alloc_;
  int64_t threshold_;
  arrow::MemoryPool* base_;
  std::mutex mu_;
  std::vector<std::vector<uint8_t*>> free_;  // by power of two
  std::map<uint8_t*, int> owned_;  // handed out: its power of two, by address
  std::atomic<int64_t> bytes_{0}, reserved_{0}, made_{0}, allocations_{0};
};

}  // namespace

extern "C" {

// The pool (never freed: Arrow's buffers may outlive any owner) as an arrow::MemoryPool*.
void* cached_pool_make(void* alloc, int64_t threshold) {
  arrow::MemoryPool* p = new CachedPool(reinterpret_cast<AllocFn>(alloc), threshold);
  return p;
}

// How many large buffers were made (not reused), and their bytes.
int64_t cached_pool_made(void* pool) {
  return static_cast<CachedPool*>(static_cast<arrow::MemoryPool*>(pool))->made();
}

int cached_pool_owns(void* pool, const void* p, int64_t n) {
  return static_cast<CachedPool*>(static_cast<arrow::MemoryPool*>(pool))->Owns(static_cast<const uint8_t*>(p), n);
}

int64_t cached_pool_reserved(void* pool) {
  return static_cast<CachedPool*>(static_cast<arrow::MemoryPool*>(pool))->reserved();
}

}  // extern "C"
