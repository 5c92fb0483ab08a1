package jstest

// The router: it pairs the two streams that present the same token and
// forwards frames unchanged.

import (
	"context"
	"errors"
	"io"

	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

type routerService struct {
	pb.UnimplementedRouterServiceServer
	c *Controller
}

type routerPeer struct {
	cancel context.CancelFunc
	stream pb.RouterService_StreamServer
}

// Stream pairs the two streams presenting the same token, like upstream's
// router_service.go: the first waits, the second forwards both ways.
func (s *routerService) Stream(st pb.RouterService_StreamServer) error {
	tok, _, err := bearer(st.Context())
	if err != nil {
		return status.Errorf(codes.Unauthenticated, "missing or invalid authorization: %v", err)
	}
	s.c.mu.Lock()
	id, ok := s.c.streamTokens[tok]
	s.c.mu.Unlock()
	if !ok {
		return status.Error(codes.Unauthenticated, "invalid router token")
	}
	ctx, cancel := context.WithCancel(st.Context())
	defer cancel()
	me := &routerPeer{cancel: cancel, stream: st}
	actual, loaded := s.c.pending.LoadOrStore(id, me)
	if loaded {
		first := actual.(*routerPeer)
		s.c.pending.CompareAndDelete(id, first)
		defer first.cancel()
		return forward(ctx, st, first.stream)
	}
	s.c.notify()
	defer s.c.notify()
	defer s.c.pending.CompareAndDelete(id, me)
	<-ctx.Done()
	return nil
}

func pipeFrames(a, b pb.RouterService_StreamServer) error {
	for {
		m, err := a.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := b.Send(&pb.StreamResponse{Payload: m.GetPayload(), FrameType: m.GetFrameType()}); err != nil {
			return err
		}
	}
}

// forward is upstream's Forward: both directions until the first error
// (or both ends).
func forward(ctx context.Context, a, b pb.RouterService_StreamServer) error {
	g, ctx := errgroup.WithContext(ctx)
	g.Go(func() error { return pipeFrames(a, b) })
	g.Go(func() error { return pipeFrames(b, a) })
	go func() { _ = g.Wait() }()
	<-ctx.Done()
	return g.Wait()
}
