// FastExp, included inside each instruction set's namespace by the CPU kernels' core headers (so that it is
// compiled, and inlined, for that instruction set). Needs <cstdint> and <cstring>.

// exp(x) in float32 for the softmax's arguments (x <= 0; -inf gives ~1e-38, i.e. 0 to the sums it feeds): 2^(x /
// ln 2) as 2^i (the exponent bits) times a degree-6 polynomial for 2^f on [0, 1) (least-squares fit, relative
// error 7e-9 before float32 rounding). Written out so that the loops over it vectorize (std::exp does not).
inline float FastExp(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  int i = static_cast<int>(t);  // toward zero: one too high for negative non-integers
  float fi = static_cast<float>(i);
  const bool over = fi > t;
  i -= over ? 1 : 0;
  fi -= over ? 1.0f : 0.0f;
  const float f = t - fi;
  const float p = 1.0f + f * (0.69314688444f + f * (0.24023030698f + f * (0.05548214912f +
                  f * (0.00967998523f + f * (0.00124379469f + f * 0.00021683432f)))));
  const int32_t bits = (i + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
