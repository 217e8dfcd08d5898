#include "types.h"

namespace pi {

TypeSize type_size(uint32_t type) {
    static const TypeSize table[] = {
        {1, 4, "f32"},      {1, 2, "f16"},      {32, 18, "q4_0"},   {32, 20, "q4_1"},    {0, 0, nullptr},
        {0, 0, nullptr},    {32, 22, "q5_0"},   {32, 24, "q5_1"},   {32, 34, "q8_0"},    {32, 40, "q8_1"},
        {256, 84, "q2_K"},  {256, 110, "q3_K"}, {256, 144, "q4_K"}, {256, 176, "q5_K"},  {256, 210, "q6_K"},
        {256, 292, "q8_K"}, {256, 66, "iq2_xxs"}, {256, 74, "iq2_xs"}, {256, 98, "iq3_xxs"}, {256, 50, "iq1_s"},
        {32, 18, "iq4_nl"}, {256, 110, "iq3_s"}, {256, 82, "iq2_s"}, {256, 136, "iq4_xs"}, {1, 1, "i8"},
        {1, 2, "i16"},      {1, 4, "i32"},      {1, 8, "i64"},      {1, 8, "f64"},       {256, 56, "iq1_m"},
        {1, 2, "bf16"},
    };
    if (type < sizeof(table) / sizeof(table[0])) return table[type];
    switch (type) {
        case 34: return {256, 54, "tq1_0"};
        case 35: return {256, 66, "tq2_0"};
        case 39: return {32, 17, "mxfp4"};
        default: return {0, 0, nullptr};
    }
}

bool type_computable(uint32_t type) {
    return type == TYPE_F32 || type == TYPE_F16 || type == TYPE_Q4_0 || type == TYPE_Q8_0;
}

}  // namespace pi
