// Bounded spin-waits: every wait on device has a %globaltimer timeout that reports and traps.
#pragma once


#include "utils.cuh"

namespace megamoe {

// One record per SM in host-mapped (pinned) memory, so the host can read it after the trap has
// poisoned the CUDA context. `valid` is written last.
// NOTES: the fields from `rank` to `tag_ptr` are laid out exactly as printf's argument buffer for the
// format in megamoe_report_timeout, so the record itself is handed to vprintf: no local-memory copy,
// hence no stack frame and no STL in the kernel (DESIGN section 3 checks).
struct TimeoutRecord {
    uint32_t rank;
    uint32_t sm_idx;
    uint32_t block_idx;
    uint32_t thread_idx;
    uint64_t waited_ns;
    int64_t values[3];
    const char* tag_ptr;  // points at `tag` below (a device-visible address of this host-mapped record)
    char tag[16];
    uint32_t valid;
    uint32_t reserved;
};
static_assert(sizeof(TimeoutRecord) == 80, "TimeoutRecord layout is mirrored in megamoe/jit/diagnostics.py");

// One record per (role, SM): simultaneous timeouts of several roles of one CTA (a pull, the GEMM pipeline behind
// it, the combine wait behind both) each keep their own. Role 0 is every unit kernel's only role.
constexpr uint32_t kNumRecordRoles = 4;
constexpr uint32_t kRecordsPerRole = 256;
constexpr uint32_t kMaxTimeoutRecords = kNumRecordRoles * kRecordsPerRole;

// The record roles of the fused kernel's warps (DeviceEnv::role)
enum RecordRole : uint32_t { kRoleCommon = 0, kRoleDispatch = 1, kRoleProducer = 2, kRoleMath = 3 };

// Passed by value to every kernel (mirrored by megamoe/jit/diagnostics.py: DeviceEnv).
struct DeviceEnv {
    uint64_t timeout_ns;
    TimeoutRecord* timeout_records;  // kMaxTimeoutRecords entries, host-mapped; may be nullptr
    uint32_t rank;
    uint32_t role;  // RecordRole: which of an SM's records a timeout writes (0 from the host)
};
static_assert(sizeof(DeviceEnv) == 24, "DeviceEnv layout is mirrored in megamoe/jit/diagnostics.py");

// Timeout tiers (DESIGN 5c): a wait that can only stall behind another wait gets a longer timeout, so the root
// cause reports first. Peer waits (NVLink barrier, pull) 1x, pool-block arrivals 2x, GEMM pipeline 3x, combine
// rows and grid syncs 4x.
enum WaitTier : uint32_t { kTierPeer = 1, kTierArrival = 2, kTierPipeline = 3, kTierCombine = 4 };

// The environment of a wait of `tier` on behalf of `role`: the same records, a longer timeout.
MEGAMOE_DEVICE DeviceEnv tiered_env(const DeviceEnv& env, WaitTier tier, RecordRole role) {
    return DeviceEnv{env.timeout_ns * tier, env.timeout_records, env.rank, role};
}

MEGAMOE_DEVICE uint64_t globaltimer_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

MEGAMOE_DEVICE uint32_t sm_id() {
    uint32_t id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

// printf whose argument buffer is caller-provided memory: the CUDA printf syscall `vprintf(fmt, args)`
// called directly. The `printf` without arguments in megamoe_report_timeout makes nvcc declare the
// syscall in the module, which this call relies on.
MEGAMOE_DEVICE void device_vprintf(const char* fmt, const void* args) {
    asm volatile(
        "{\n"
        ".param .b64 fmt_param;\n"
        ".param .b64 args_param;\n"
        ".param .b32 ret_param;\n"
        "st.param.b64 [fmt_param], %0;\n"
        "st.param.b64 [args_param], %1;\n"
        "call.uni (ret_param), vprintf, (fmt_param, args_param);\n"
        "}\n" ::"l"(fmt), "l"(args)
        : "memory");
}

// Cold path: record the diagnostic (rank, SM, block, thread, wait, values, tag), print it, trap.
// kPrint = false skips the printf: any function call (printf is one) in a warpgroup that issues WGMMA makes
// ptxas serialize its wgmma pipeline (C7510), so the math warpgroups report through the record only.
template <bool kPrint>
MEGAMOE_DEVICE void report_timeout_body(const DeviceEnv& env, const char* tag, uint64_t waited_ns, int64_t v0,
                                        int64_t v1, int64_t v2) {
    const uint32_t sm_idx = sm_id();
    if (env.timeout_records != nullptr) {
        TimeoutRecord* rec = env.timeout_records + (env.role % kNumRecordRoles) * kRecordsPerRole +
                             sm_idx % kRecordsPerRole;
        rec->rank = env.rank;
        rec->sm_idx = sm_idx;
        rec->block_idx = blockIdx.x;
        rec->thread_idx = threadIdx.x;
        rec->waited_ns = waited_ns;
        rec->values[0] = v0;
        rec->values[1] = v1;
        rec->values[2] = v2;
        int i = 0;
        for (; i < 15 and tag[i] != '\0'; ++ i)
            rec->tag[i] = tag[i];
        rec->tag[i] = '\0';
        rec->tag_ptr = rec->tag;
        __threadfence_system();
        rec->valid = 1;
        __threadfence_system();
        if constexpr (kPrint)
            device_vprintf("megamoe timeout: rank %u sm %u block %u thread %u waited %llu ns values (%lld, %lld, %lld) "
                       "at '%s'\n", rec);
    } else if constexpr (kPrint) {
        printf("megamoe timeout (no host-mapped record to report values to)\n");
    }
    __trap();
}

// The same report out of line, in a function PTX marks `.noreturn`: ptxas then keeps nothing of the waiting
// code alive through it (parameters go in registers: no stack frame).
template <bool kPrint>
__device__ __noinline__ __attribute__((noreturn)) void report_timeout_noreturn(DeviceEnv env, const char* tag,
                                                                               uint64_t waited_ns, int64_t v0,
                                                                               int64_t v1, int64_t v2) {
    report_timeout_body<kPrint>(env, tag, waited_ns, v0, v1, v2);
    __builtin_unreachable();
}

// Where a timeout's report runs (DESIGN 5c).
// NOTES: inlined, ptxas treats the trap path as one that returns, so the wait's loop state stays live through
// the report's own values: in the fused kernel that spilled 64-68 B in the head and the 56-register WG0 roles
// (timeout record stores, values reloaded around them); out of line (kCall) 0 B, with the head's NVLink ordinal
// re-read (assembler/fused_kernel.cuh). In a warpgroup that issues WGMMA the call itself costs: the math waits
// out of line spilled ~1 KB in the math region of the BLOCK_M 64 variants, so those waits keep the report inline
// (kInline), with which they are at 0 spills.
enum class ReportSite : uint32_t { kCall = 0, kInline = 1 };

template <bool kPrint, ReportSite kSite = ReportSite::kCall>
MEGAMOE_DEVICE void megamoe_report_timeout(const DeviceEnv& env, const char* tag, uint64_t waited_ns, int64_t v0,
                                           int64_t v1, int64_t v2) {
    if constexpr (kSite == ReportSite::kCall)
        report_timeout_noreturn<kPrint>(env, tag, waited_ns, v0, v1, v2);
    else
        report_timeout_body<kPrint>(env, tag, waited_ns, v0, v1, v2);
}

// Spin until `done()` holds; past env.timeout_ns, report (tag, values()) at kSite and trap.
// `done` is polled first without reading the timer, so an uncontended wait costs one poll.
template <bool kPrint = true, ReportSite kSite = ReportSite::kCall, typename Done, typename Values>
MEGAMOE_DEVICE void bounded_wait(const DeviceEnv& env, const char* tag, const Done& done, const Values& values) {
    if (done())
        return;
    const uint64_t start_ns = globaltimer_ns();
    while (not done()) {
        const uint64_t waited_ns = globaltimer_ns() - start_ns;
        if (waited_ns > env.timeout_ns) {
            const auto v = values();
            megamoe_report_timeout<kPrint, kSite>(env, tag, waited_ns, v.x, v.y, v.z);
        }
    }
}

}  // namespace megamoe
