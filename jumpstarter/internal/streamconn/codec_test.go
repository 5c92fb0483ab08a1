package streamconn

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// split cuts b into a BufferSlice of pieces of at most n bytes, as gRPC
// hands over a message received in several HTTP/2 DATA frames.
func split(b []byte, n int) mem.BufferSlice {
	var s mem.BufferSlice
	for len(b) > 0 {
		k := min(n, len(b))
		s = append(s, mem.SliceBuffer(append([]byte(nil), b[:k]...)))
		b = b[k:]
	}
	return s
}

func TestCodecDecodesFramesAsProto(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 5000) // 80000 bytes
	cases := map[string]*pb.StreamRequest{
		"data":       {Payload: big, FrameType: pb.FrameType_FRAME_TYPE_DATA},
		"goaway":     {FrameType: pb.FrameType_FRAME_TYPE_GOAWAY},
		"small":      {Payload: []byte("x")},
		"empty":      {},
		"ping+bytes": {Payload: []byte("ping"), FrameType: pb.FrameType_FRAME_TYPE_PING},
	}
	for name, m := range cases {
		t.Run(name, func(t *testing.T) {
			wire, err := proto.Marshal(m)
			require.NoError(t, err)
			for _, piece := range []int{1, 7, 16384, 1 << 20} {
				var got pb.StreamRequest
				require.NoError(t, Codec.Unmarshal(split(wire, piece), &got))
				assert.True(t, bytes.Equal(m.GetPayload(), got.GetPayload()), "payload, pieces of %d", piece)
				assert.Equal(t, m.GetFrameType(), got.GetFrameType())
				var resp pb.StreamResponse
				require.NoError(t, Codec.Unmarshal(split(wire, piece), &resp))
				assert.True(t, bytes.Equal(m.GetPayload(), resp.GetPayload()))
				assert.Equal(t, m.GetFrameType(), resp.GetFrameType())
			}
		})
	}
}

func TestCodecFallsBackOnOtherEncodings(t *testing.T) {
	// Fields out of order, an unknown field, a repeated payload (the last
	// wins): the proto codec's reading, unknown fields kept.
	var wire []byte
	wire = protowire.AppendTag(wire, 2, protowire.VarintType)
	wire = protowire.AppendVarint(wire, uint64(pb.FrameType_FRAME_TYPE_DATA))
	wire = protowire.AppendTag(wire, 1, protowire.BytesType)
	wire = protowire.AppendBytes(wire, []byte("first"))
	wire = protowire.AppendTag(wire, 1, protowire.BytesType)
	wire = protowire.AppendBytes(wire, []byte("second"))
	wire = protowire.AppendTag(wire, 9, protowire.VarintType)
	wire = protowire.AppendVarint(wire, 42)
	var got, want pb.StreamRequest
	require.NoError(t, proto.Unmarshal(wire, &want))
	require.NoError(t, Codec.Unmarshal(split(wire, 3), &got))
	assert.True(t, proto.Equal(&want, &got))
	assert.Equal(t, "second", string(got.GetPayload()))
	assert.NotEmpty(t, got.ProtoReflect().GetUnknown(), "the unknown field is kept")

	// A truncated payload is an error, as for proto.
	trunc := protowire.AppendTag(nil, 1, protowire.BytesType)
	trunc = protowire.AppendVarint(trunc, 100)
	trunc = append(trunc, "short"...)
	assert.Error(t, Codec.Unmarshal(split(trunc, 4), &got))

	// Other messages are the proto codec's.
	req := &pb.DriverCallRequest{Uuid: "u", Method: "m"}
	b, err := Codec.Marshal(req)
	require.NoError(t, err)
	var back pb.DriverCallRequest
	require.NoError(t, Codec.Unmarshal(b, &back))
	assert.True(t, proto.Equal(req, &back))
}

func TestTieredPool(t *testing.T) {
	p := newTieredPool(8, 12)
	for _, c := range []struct{ n, cap int }{{0, 256}, {1, 256}, {256, 256}, {257, 512}, {4096, 4096}} {
		b := p.Get(c.n)
		assert.Len(t, *b, c.n)
		assert.Equal(t, c.cap, cap(*b), "Get(%d)", c.n)
		p.Put(b)
	}
	big := p.Get(4097) // beyond the largest tier: allocated, not pooled
	assert.Len(t, *big, 4097)
	p.Put(big)
	odd := make([]byte, 300) // not a tier's size: dropped
	p.Put(&odd)
	b := p.Get(300)
	assert.Equal(t, 512, cap(*b))
}

func TestPooledFramesReleasedOnceRead(t *testing.T) {
	f := &chanFrames{in: make(chan frame, 2)}
	rel := &releaseFrames{Frames: f}
	c := New(rel, nil, "test")
	defer c.Close()
	f.in <- frame{[]byte("hello"), pb.FrameType_FRAME_TYPE_DATA}
	buf := make([]byte, 3)
	n, err := c.Read(buf)
	require.NoError(t, err)
	assert.Equal(t, "hel", string(buf[:n]))
	assert.Empty(t, rel.released, "a frame partly read is still in use")
	n, err = c.Read(buf)
	require.NoError(t, err)
	assert.Equal(t, "lo", string(buf[:n]))
	assert.Equal(t, []string{"hello"}, rel.released)
}

type releaseFrames struct {
	Frames
	released []string
}

func (r *releaseFrames) release(p []byte) { r.released = append(r.released, string(p)) }

func TestCodecEncodesFramesAsProto(t *testing.T) {
	big := bytes.Repeat([]byte("0123456789abcdef"), 5000)
	for _, m := range []*pb.StreamRequest{
		{Payload: big},
		{Payload: big, FrameType: pb.FrameType_FRAME_TYPE_PING},
		{Payload: []byte("small"), FrameType: pb.FrameType_FRAME_TYPE_GOAWAY},
		{FrameType: pb.FrameType_FRAME_TYPE_GOAWAY},
		{},
	} {
		want, err := proto.Marshal(m)
		require.NoError(t, err)
		got, err := Codec.Marshal(m)
		require.NoError(t, err)
		assert.True(t, bytes.Equal(want, got.Materialize()), "request %d bytes %s", len(m.GetPayload()), m.GetFrameType())
		resp := &pb.StreamResponse{Payload: m.GetPayload(), FrameType: m.GetFrameType()}
		got, err = Codec.Marshal(resp)
		require.NoError(t, err)
		assert.True(t, bytes.Equal(want, got.Materialize()), "response %d bytes %s", len(m.GetPayload()), m.GetFrameType())
		got.Free()
	}
	// Unknown fields are kept: the proto codec's path.
	var withUnknown pb.StreamRequest
	wire := protowire.AppendTag(nil, 1, protowire.BytesType)
	wire = protowire.AppendBytes(wire, big)
	wire = protowire.AppendTag(wire, 9, protowire.VarintType)
	wire = protowire.AppendVarint(wire, 42)
	require.NoError(t, proto.Unmarshal(wire, &withUnknown))
	got, err := Codec.Marshal(&withUnknown)
	require.NoError(t, err)
	assert.Equal(t, wire, got.Materialize())
}
