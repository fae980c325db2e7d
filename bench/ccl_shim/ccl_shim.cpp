// A C ABI over oneCCL's C++ API for bench/backends.py (loaded with ctypes): one KVS, one communicator and an
// in-place sum all-reduce of fp32 or bf16 buffers given by pointer and element count. Written for this project.
// Every call returns 0 on success or -1 with the exception's text in xc_ccl_error(), kept per thread (the bench's
// asynchronous comm hook all-reduces on a worker thread of its own).
#include <oneapi/ccl.hpp>

#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <string>

// The CPU-only static libccl.a refers to ittnotify's function pointers but does not define them; with no
// profiler collector loaded they stay null and oneCCL's tracing is skipped.
extern "C" {
void* __itt_domain_create_ptr__3_0 = nullptr;
void* __itt_event_create_ptr__3_0 = nullptr;
void* __itt_event_end_ptr__3_0 = nullptr;
void* __itt_event_start_ptr__3_0 = nullptr;
void* __itt_metadata_add_ptr__3_0 = nullptr;
void* __itt_string_handle_create_ptr__3_0 = nullptr;
void* __itt_task_begin_ptr__3_0 = nullptr;
void* __itt_task_end_ptr__3_0 = nullptr;
void* __itt_thread_set_name_ptr__3_0 = nullptr;
}

namespace {
thread_local std::string last_error;
std::shared_ptr<ccl::kvs> kvs;
std::optional<ccl::communicator> comm;

template <class F>
int guarded(F&& body) {
    try {
        body();
        return 0;
    } catch (const std::exception& e) {
        last_error = e.what();
    } catch (...) {
        last_error = "unknown exception";
    }
    return -1;
}
}  // namespace

extern "C" {

const char* xc_ccl_error() { return last_error.c_str(); }

int xc_ccl_address_size() { return static_cast<int>(ccl::kvs::address_max_size); }

int xc_ccl_init() { return guarded([] { ccl::init(); }); }

// Rank 0: makes the main KVS and writes its address (xc_ccl_address_size() bytes) into out.
int xc_ccl_main_kvs(char* out) {
    return guarded([out] {
        kvs = ccl::create_main_kvs();
        auto addr = kvs->get_address();
        std::memcpy(out, addr.data(), addr.size());
    });
}

// The other ranks: joins the KVS at the address rank 0 wrote.
int xc_ccl_kvs_from(const char* address) {
    return guarded([address] {
        ccl::kvs::address_type addr;
        std::memcpy(addr.data(), address, addr.size());
        kvs = ccl::create_kvs(addr);
    });
}

int xc_ccl_comm(int size, int rank) {
    return guarded([size, rank] { comm.emplace(ccl::create_communicator(size, rank, kvs)); });
}

// dtype: 0 float32, 1 bfloat16. Blocks until the sum is in buf.
int xc_ccl_allreduce_sum(void* buf, size_t count, int dtype) {
    return guarded([buf, count, dtype] {
        if (!comm) throw std::runtime_error("no communicator: call xc_ccl_comm first");
        auto type = dtype == 1 ? ccl::datatype::bfloat16 : ccl::datatype::float32;
        ccl::allreduce(buf, buf, count, type, ccl::reduction::sum, *comm).wait();
    });
}

int xc_ccl_free() {
    return guarded([] {
        comm.reset();
        kvs.reset();
    });
}

}  // extern "C"
