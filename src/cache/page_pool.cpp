// PagePool bookkeeping (see page_pool.h).
#include "cache/page_pool.h"

#include "core/check.h"

namespace kestrel::cache {

PagePool::PagePool(int32_t num_pages, int block_size) : block_size_(block_size) {
  if (num_pages <= 0) fail("page pool: need at least one page, got {}", num_pages);
  if (block_size <= 0) fail("page pool: block size must be positive, got {}", block_size);
  refcount_.assign(size_t(num_pages), 0);
  is_free_.assign(size_t(num_pages), true);
  free_.reserve(size_t(num_pages));
  // Highest id at the bottom so the first allocations get 0, 1, 2, ... (readable test output).
  for (PageId p = num_pages - 1; p >= 0; --p) free_.push_back(p);
}

void PagePool::check_id(PageId p) const {
  KCHECK(p >= 0 && p < num_pages(), "page id {} outside [0, {})", p, num_pages());
}

int32_t PagePool::refcount(PageId p) const {
  check_id(p);
  return refcount_[size_t(p)];
}

bool PagePool::allocate(int32_t n, std::vector<PageId>& out) {
  KCHECK(n >= 0, "negative page count {}", n);
  if (n > num_free()) return false;
  for (int32_t i = 0; i < n; ++i) {
    const PageId p = free_.back();
    free_.pop_back();
    is_free_[size_t(p)] = false;
    refcount_[size_t(p)] = 1;
    out.push_back(p);
  }
  return true;
}

void PagePool::ref(PageId p) {
  check_id(p);
  KCHECK(refcount_[size_t(p)] > 0, "ref of free page {}", p);
  ++refcount_[size_t(p)];
}

void PagePool::unref(PageId p) {
  check_id(p);
  KCHECK(refcount_[size_t(p)] > 0, "unref of free page {}", p);
  if (--refcount_[size_t(p)] == 0) {
    is_free_[size_t(p)] = true;
    free_.push_back(p);
  }
}

void PagePool::check_integrity() const {
  std::vector<bool> seen(refcount_.size(), false);
  for (PageId p : free_) {
    KCHECK(p >= 0 && p < num_pages(), "free list holds bad id {}", p);
    KCHECK(!seen[size_t(p)], "page {} twice on the free list", p);
    seen[size_t(p)] = true;
  }
  for (PageId p = 0; p < num_pages(); ++p) {
    const int32_t rc = refcount_[size_t(p)];
    KCHECK(rc >= 0, "page {} refcount {}", p, rc);
    KCHECK(seen[size_t(p)] == (rc == 0), "page {} refcount {} but on free list: {}", p, rc, bool(seen[size_t(p)]));
    KCHECK(is_free_[size_t(p)] == (rc == 0), "page {} free flag disagrees with refcount {}", p, rc);
  }
}

}  // namespace kestrel::cache
