// The emulated CUDA device: specinfer's kernels (`specinfer.cu`, the file NVRTC compiles) built
// as C++ for the host, and a launcher that runs a grid the way the hardware's programming model
// says it runs. Blocks run one after another on the calling thread; the threads of a block run
// as fibers that switch only at `__syncthreads` and warp shuffles, so that barriers inside loops
// and helpers work as written; a large grid's blocks are shared among a few host threads (as a
// GPU runs blocks concurrently, in no set order). A launch is checked as the driver checks it (block size, shared
// memory, grid, the kernel's arguments by count and size), and a barrier or a shuffle that some
// threads of a block never reach is reported as the launch's error instead of hanging.
//
// What it cannot show: the driver, NVRTC, loading machine code, the hardware's concurrency (warps
// of a block here never overlap: the fibers run in thread order between synchronisation points,
// one legal schedule of many) and timing.

#include "emulation.h"

#include "specinfer.cu"

#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace emu {

thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;

namespace {

enum class State { Ready, AtBarrier, AtShuffle, Done, Failed };

struct Fiber {
    void* sp = nullptr;
    State state = State::Ready;
    unsigned shuffles = 0;  // shuffles this thread has made (its generation)
};

// Bytes of stack per fiber (the kernels keep a few dozen floats; libm's pow, sin and cos some
// hundreds of bytes), with a guard page below each.
constexpr size_t STACK_BYTES = 64 * 1024;

struct Block {
    void (*run)(void**) = nullptr;
    void** params = nullptr;
    unsigned threads = 0;
    std::vector<Fiber> fibers;
    unsigned current = 0;
    void* scheduler_sp = nullptr;
    std::vector<unsigned char> shared;
    // Per warp, two generations of 32 lanes' shuffle values (a lane can be one shuffle ahead of
    // the slowest lane of its warp, never two).
    std::vector<unsigned long long> lanes;
    std::string error;
};

thread_local Block* running = nullptr;

// Fiber stacks, kept between launches (mapped once per host thread for the largest block).
struct Stacks {
    unsigned char* base = nullptr;
    size_t count = 0;
    size_t slot = 0;
    ~Stacks() {
        if (base) munmap(base, count * slot);
    }
    bool fit(size_t n) {
        if (n <= count) return true;
        if (base) munmap(base, count * slot);
        const size_t page = (size_t)sysconf(_SC_PAGESIZE);
        slot = STACK_BYTES + page;
        void* m = mmap(nullptr, n * slot, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) {
            base = nullptr;
            count = 0;
            return false;
        }
        base = static_cast<unsigned char*>(m);
        count = n;
        for (size_t i = 0; i < n; i++) mprotect(base + i * slot, page, PROT_NONE);
        return true;
    }
    unsigned char* top(size_t i) const { return base + (i + 1) * slot; }
};
thread_local Stacks stacks;

}  // namespace
}  // namespace emu

// Switching between fibers: save the callee-saved registers on the current stack, store the
// stack pointer in *from, load `to` and restore what it saved. A new fiber's stack is laid out
// as if it had switched away just before entering `emu_fiber_entry`.
extern "C" void emu_switch(void** from, void* to);
extern "C" void emu_fiber_entry();

#if defined(__x86_64__)
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");

static void* initial_sp(unsigned char* top) {
    uintptr_t* sp = reinterpret_cast<uintptr_t*>(top);
    *--sp = 0;  // the entry's return address (it never returns); keeps the ABI's alignment
    *--sp = reinterpret_cast<uintptr_t>(&emu_fiber_entry);
    for (int i = 0; i < 6; i++) *--sp = 0;  // rbp, rbx, r12-r15
    return sp;
}
#elif defined(__aarch64__)
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, %function
emu_switch:
    sub sp, sp, #176
    stp x19, x20, [sp, #0]
    stp x21, x22, [sp, #16]
    stp x23, x24, [sp, #32]
    stp x25, x26, [sp, #48]
    stp x27, x28, [sp, #64]
    stp x29, x30, [sp, #80]
    stp d8, d9, [sp, #96]
    stp d10, d11, [sp, #112]
    stp d12, d13, [sp, #128]
    stp d14, d15, [sp, #144]
    mov x9, sp
    str x9, [x0]
    mov sp, x1
    ldp x19, x20, [sp, #0]
    ldp x21, x22, [sp, #16]
    ldp x23, x24, [sp, #32]
    ldp x25, x26, [sp, #48]
    ldp x27, x28, [sp, #64]
    ldp x29, x30, [sp, #80]
    ldp d8, d9, [sp, #96]
    ldp d10, d11, [sp, #112]
    ldp d12, d13, [sp, #128]
    ldp d14, d15, [sp, #144]
    add sp, sp, #176
    ret
    .size emu_switch, .-emu_switch
)");

static void* initial_sp(unsigned char* top) {
    uintptr_t* sp = reinterpret_cast<uintptr_t*>(top) - 22;
    for (int i = 0; i < 22; i++) sp[i] = 0;
    sp[11] = reinterpret_cast<uintptr_t>(&emu_fiber_entry);  // x30, where `ret` goes
    return sp;
}
#else
#error "the emulated CUDA device switches fibers on x86-64 and aarch64 only"
#endif

namespace emu {
namespace {

void set_thread(unsigned tid) {
    const unsigned bx = block_dim.x, by = block_dim.y;
    thread_idx = dim3{tid % bx, (tid / bx) % by, tid / (bx * by)};
}

// From the running fiber back to the block's scheduler.
void yield_to_scheduler() {
    Block* b = running;
    emu_switch(&b->fibers[b->current].sp, b->scheduler_sp);
}

// Ends the launch with `what` (the fiber is abandoned: kernels hold no resources).
[[noreturn]] void fail(const std::string& what) {
    Block* b = running;
    if (b->error.empty()) b->error = what;
    b->fibers[b->current].state = State::Failed;
    yield_to_scheduler();
    __builtin_unreachable();
}

std::string where() {
    char buf[96];
    snprintf(buf, sizeof buf, "block (%u, %u, %u), thread %u", block_idx.x, block_idx.y,
             block_idx.z, running->current);
    return buf;
}

// Runs one block to its end; false with b.error set when it fails.
bool run_block(Block& b) {
    b.fibers.assign(b.threads, Fiber{});
    for (unsigned i = 0; i < b.threads; i++) b.fibers[i].sp = initial_sp(stacks.top(i));
    std::fill(b.shared.begin(), b.shared.end(), (unsigned char)0xff);
    running = &b;
    const unsigned warps = (b.threads + 31) / 32;
    for (;;) {
        for (unsigned i = 0; i < b.threads; i++) {
            if (b.fibers[i].state != State::Ready) continue;
            b.current = i;
            set_thread(i);
            emu_switch(&b.scheduler_sp, b.fibers[i].sp);
            if (b.fibers[i].state == State::Failed) return false;
        }
        // Every fiber now waits or has finished: release what can go on.
        bool released = false;
        for (unsigned w = 0; w < warps; w++) {
            const unsigned lo = 32 * w, hi = std::min(b.threads, lo + 32);
            bool all = hi - lo == 32;
            for (unsigned i = lo; i < hi && all; i++) all = b.fibers[i].state == State::AtShuffle;
            if (all) {
                for (unsigned i = lo; i < hi; i++) b.fibers[i].state = State::Ready;
                released = true;
            }
        }
        if (released) continue;
        unsigned done = 0, barrier = 0, shuffle = 0;
        for (const Fiber& f : b.fibers) {
            done += f.state == State::Done;
            barrier += f.state == State::AtBarrier;
            shuffle += f.state == State::AtShuffle;
        }
        if (done == b.threads) return true;
        char buf[256];
        if (shuffle == 0 && done == 0) {
            for (Fiber& f : b.fibers) f.state = State::Ready;
            continue;
        }
        if (shuffle == 0) {
            snprintf(buf, sizeof buf,
                     "block (%u, %u, %u): __syncthreads reached by %u of its %u threads; the "
                     "other %u had returned",
                     block_idx.x, block_idx.y, block_idx.z, barrier, b.threads, done);
        } else {
            unsigned w = 0;
            while (w < warps) {
                const unsigned lo = 32 * w, hi = std::min(b.threads, lo + 32);
                bool some = false;
                for (unsigned i = lo; i < hi; i++) some |= b.fibers[i].state == State::AtShuffle;
                if (some) break;
                w++;
            }
            const unsigned lo = 32 * w, hi = std::min(b.threads, lo + 32);
            unsigned at = 0;
            for (unsigned i = lo; i < hi; i++) at += b.fibers[i].state == State::AtShuffle;
            snprintf(buf, sizeof buf,
                     "block (%u, %u, %u), warp %u: a warp shuffle reached by %u of its 32 lanes "
                     "(the others returned, wait at __syncthreads or do not exist)",
                     block_idx.x, block_idx.y, block_idx.z, w, at);
        }
        b.error = buf;
        return false;
    }
}

}  // namespace

void syncthreads() {
    Block* b = running;
    b->fibers[b->current].state = State::AtBarrier;
    yield_to_scheduler();
}

unsigned long long shuffle_xor(unsigned mask, unsigned long long bits, int lane_mask) {
    Block* b = running;
    if (mask != 0xffffffffu) fail(where() + ": a warp shuffle with a partial mask");
    const unsigned tid = b->current, lane = tid % 32, warp = tid / 32;
    Fiber& me = b->fibers[tid];
    unsigned long long* slots = &b->lanes[(warp * 2 + me.shuffles % 2) * 32];
    me.shuffles++;
    slots[lane] = bits;
    me.state = State::AtShuffle;
    yield_to_scheduler();
    const unsigned from = lane ^ (unsigned)lane_mask;
    return from < 32 ? slots[from] : bits;
}

void* dynamic_shared() { return running->shared.data(); }

}  // namespace emu

extern "C" void emu_fiber_entry() {
    emu::Block* b = emu::running;
    b->run(b->params);
    b->fibers[b->current].state = emu::State::Done;
    emu::yield_to_scheduler();
    __builtin_unreachable();
}

namespace {

// Calls kernel F with its arguments read from CUDA-style kernel parameters (an array of pointers
// to each argument's value).
template <auto F>
struct Entry;

template <typename... A, void (*F)(A...)>
struct Entry<F> {
    template <size_t... I>
    static void call(void** p, std::index_sequence<I...>) {
        F(*static_cast<A*>(p[I])...);
    }
    static void run(void** p) { call(p, std::index_sequence_for<A...>{}); }
    static constexpr size_t count = sizeof...(A);
    static constexpr size_t sizes[sizeof...(A) + 1] = {sizeof(A)..., 0};
};

struct Kernel {
    const char* name;
    void (*run)(void**);
    size_t count;
    const size_t* sizes;
};

#define KERNEL(k) Kernel{#k, &Entry<&k>::run, Entry<&k>::count, Entry<&k>::sizes}

const Kernel KERNELS[] = {
    KERNEL(rms_norm),         KERNEL(rope),         KERNEL(linear_f32),
    KERNEL(linear_bf16),      KERNEL(swiglu),       KERNEL(add_into),
    KERNEL(gather_rows),      KERNEL(store_kv_f32), KERNEL(store_kv_bf16),
    KERNEL(tree_attention_f32), KERNEL(tree_attention_bf16), KERNEL(attention_combine),
    KERNEL(argmax_rows),
    KERNEL(softmax_top_p),    KERNEL(sample_walk),
};

// Host threads that help run a large grid's blocks, started once and kept (their fiber stacks
// with them). One launch uses them at a time.
class Helpers {
  public:
    static Helpers& get() {
        // Leaked on purpose: its threads wait forever, and joining them at exit would hang.
        static Helpers* helpers = new Helpers(
            std::min(3u, std::max(1u, std::thread::hardware_concurrency()) - 1));
        return *helpers;
    }
    size_t size() const { return count_; }
    // Runs `job` on every helper and on the calling thread, returning when all have finished.
    void run(const std::function<void()>& job) {
        std::lock_guard<std::mutex> one_launch(launch_);
        {
            std::lock_guard<std::mutex> g(m_);
            job_ = &job;
            active_ = count_;
            generation_++;
        }
        start_.notify_all();
        job();
        std::unique_lock<std::mutex> g(m_);
        finished_.wait(g, [&] { return active_ == 0; });
    }

  private:
    explicit Helpers(unsigned n) : count_(n) {
        for (unsigned i = 0; i < n; i++) std::thread([this] { serve(); }).detach();
    }
    void serve() {
        unsigned long long seen = 0;
        for (;;) {
            const std::function<void()>* job;
            {
                std::unique_lock<std::mutex> g(m_);
                start_.wait(g, [&] { return generation_ != seen; });
                seen = generation_;
                job = job_;
            }
            (*job)();
            std::lock_guard<std::mutex> g(m_);
            if (--active_ == 0) finished_.notify_all();
        }
    }
    const size_t count_;
    std::mutex launch_, m_;
    std::condition_variable start_, finished_;
    const std::function<void()>* job_ = nullptr;
    unsigned long long generation_ = 0;
    size_t active_ = 0;
};

// The limits of the devices specinfer supports (compute capability 7.5 and newer) that a launch
// must respect without opting in to more.
constexpr unsigned MAX_BLOCK_THREADS = 1024, MAX_BLOCK_Z = 64, MAX_GRID_YZ = 65535;
constexpr unsigned MAX_SHARED_BYTES = 48 * 1024;

int failed(char* err, size_t len, const std::string& what) {
    if (len > 0) snprintf(err, len, "%s", what.c_str());
    return 1;
}

}  // namespace

// Runs kernel `name` over grid x block with `shared` bytes of dynamic shared memory; `params`
// points to `count` argument values of `sizes` bytes. 0 on success, else 1 with the reason in
// `err` (up to `err_len` bytes).
extern "C" int specinfer_emulated_launch(const char* name, const unsigned grid[3],
                                         const unsigned block[3], unsigned shared, void** params,
                                         const size_t* sizes, size_t count, char* err,
                                         size_t err_len) {
    const Kernel* k = nullptr;
    for (const Kernel& c : KERNELS)
        if (strcmp(c.name, name) == 0) k = &c;
    if (!k) return failed(err, err_len, std::string("no kernel named ") + name);
    if (count != k->count) {
        return failed(err, err_len,
                      std::string(name) + " takes " + std::to_string(k->count) +
                          " arguments, the launch gave " + std::to_string(count));
    }
    for (size_t i = 0; i < count; i++) {
        if (sizes[i] != k->sizes[i]) {
            return failed(err, err_len,
                          std::string(name) + ": argument " + std::to_string(i) + " is " +
                              std::to_string(k->sizes[i]) + " bytes, the launch gave " +
                              std::to_string(sizes[i]));
        }
    }
    const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (threads == 0 || threads > MAX_BLOCK_THREADS || block[2] > MAX_BLOCK_Z) {
        return failed(err, err_len,
                      std::string(name) + ": invalid block (" + std::to_string(block[0]) + ", " +
                          std::to_string(block[1]) + ", " + std::to_string(block[2]) + ")");
    }
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > MAX_GRID_YZ ||
        grid[2] > MAX_GRID_YZ || grid[0] > 0x7fffffffu) {
        return failed(err, err_len,
                      std::string(name) + ": invalid grid (" + std::to_string(grid[0]) + ", " +
                          std::to_string(grid[1]) + ", " + std::to_string(grid[2]) + ")");
    }
    if (shared > MAX_SHARED_BYTES) {
        return failed(err, err_len,
                      std::string(name) + ": " + std::to_string(shared) +
                          " bytes of dynamic shared memory (at most 48 KiB)");
    }
    if (emu::running) return failed(err, err_len, "a launch from inside a kernel");
    const unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    // Blocks handed out one at a time to the calling thread and, for a grid of 16 blocks or
    // more, the helpers; the first failure stops the others at their next block.
    std::atomic<unsigned long long> next{0};
    std::atomic<bool> stop{false};
    std::mutex first_error_lock;
    std::string first_error;
    const std::function<void()> work = [&]() {
        if (!emu::stacks.fit(threads)) {
            std::lock_guard<std::mutex> g(first_error_lock);
            if (first_error.empty()) first_error = "no memory for fiber stacks";
            stop = true;
            return;
        }
        emu::Block b;
        b.run = k->run;
        b.params = params;
        b.threads = (unsigned)threads;
        b.shared.resize(shared);
        b.lanes.assign(((threads + 31) / 32) * 64, 0);
        emu::block_dim = dim3{block[0], block[1], block[2]};
        emu::grid_dim = dim3{grid[0], grid[1], grid[2]};
        for (unsigned long long i; !stop && (i = next++) < blocks;) {
            emu::block_idx = dim3{(unsigned)(i % grid[0]), (unsigned)((i / grid[0]) % grid[1]),
                                  (unsigned)(i / ((unsigned long long)grid[0] * grid[1]))};
            if (!emu::run_block(b)) {
                std::lock_guard<std::mutex> g(first_error_lock);
                if (first_error.empty()) first_error = b.error;
                stop = true;
            }
        }
        emu::running = nullptr;
    };
    if (blocks >= 16 && Helpers::get().size() > 0) {
        Helpers::get().run(work);
    } else {
        work();
    }
    if (!first_error.empty()) return failed(err, err_len, std::string(name) + ": " + first_error);
    return 0;
}
