// PagePool: a fixed set of cache pages with reference counts; BlockTable: one request's pages.
//
// A page is free exactly when its refcount is 0. Holders are block tables of running requests and
// prefix-cache entries; a page shared by a cached prefix and the requests reading it has one count
// per holder. The free list is a stack (LIFO) so recently freed, likely still-warm pages are reused
// first; `is_free_` mirrors it so a double free is caught in O(1). Allocation of n pages is
// all-or-nothing: a half-grown block table would need undoing on every failure path.
#pragma once

#include <cstdint>
#include <vector>

namespace kestrel::cache {

using PageId = int32_t;

class PagePool {
 public:
  PagePool(int32_t num_pages, int block_size = 128);

  int32_t num_pages() const { return int32_t(refcount_.size()); }
  int32_t num_free() const { return int32_t(free_.size()); }
  int block_size() const { return block_size_; }
  int32_t refcount(PageId p) const;

  // Appends n fresh pages (refcount 1) to `out`; false, with nothing changed, when fewer are free.
  bool allocate(int32_t n, std::vector<PageId>& out);
  void ref(PageId p);    // another holder of an allocated page
  void unref(PageId p);  // a holder lets go; the page is free again at 0

  // Free list and refcounts agree; throws kestrel::Error naming the first violation.
  void check_integrity() const;

 private:
  void check_id(PageId p) const;

  int block_size_;
  std::vector<int32_t> refcount_;
  std::vector<PageId> free_;
  std::vector<bool> is_free_;
};

// The pages of one request, in token order: token t lives in pages[t / block_size] at t % block_size.
struct BlockTable {
  std::vector<PageId> pages;
  int64_t num_tokens = 0;  // tokens whose cache entries are (or are being) written
};

}  // namespace kestrel::cache
