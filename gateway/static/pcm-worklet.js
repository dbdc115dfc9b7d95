// AudioWorklet: microphone float samples at the context's rate -> 16 kHz PCM s16le.
//
// Each output sample is the mean of the input samples in its interval of
// sampleRate / 16000 input samples (a box filter, so 48 kHz and 44.1 kHz both work
// and little aliases into the speech band). Frames of `frameMs` go to the page
// as transferable ArrayBuffers.
const TARGET_RATE = 16000;

class PcmWorklet extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const frameMs = (options.processorOptions && options.processorOptions.frameMs) || 100;
    this.ratio = sampleRate / TARGET_RATE;
    this.frame = new Int16Array(Math.round(TARGET_RATE * frameMs / 1000));
    this.filled = 0;
    this.sum = 0;
    this.count = 0;
    this.position = 0; // input samples consumed, relative to the current output sample
  }

  emit(value) {
    const clipped = Math.max(-1, Math.min(1, value));
    this.frame[this.filled++] = clipped < 0 ? clipped * 0x8000 : clipped * 0x7fff;
    if (this.filled === this.frame.length) {
      const out = this.frame.slice().buffer;
      this.port.postMessage(out, [out]);
      this.filled = 0;
    }
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    for (let i = 0; i < channel.length; i++) {
      this.sum += channel[i];
      this.count += 1;
      this.position += 1;
      if (this.position >= this.ratio) {
        this.emit(this.sum / this.count);
        this.position -= this.ratio;
        this.sum = 0;
        this.count = 0;
      }
    }
    return true;
  }
}

registerProcessor("pcm-worklet", PcmWorklet);
