/* One kernel parameter's bytes, as cuLaunchKernel reads them (a pointer to each): shared by
 * native_launch.c and native_plans.cpp. */
#ifndef LLMSYS_NATIVE_SLOT_H
#define LLMSYS_NATIVE_SLOT_H

#include <stdint.h>

typedef union {
    uint64_t u64;
    int64_t i64;
    uint32_t u32;
    int32_t i32;
    int8_t i8;
    float f32;
    double f64;
} Slot;

#endif
