package jstest

// Authentication of calls: the bearer token, and what it identifies.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

func bearer(ctx context.Context) (string, metadata.MD, error) {
	md, ok := metadata.FromIncomingContext(ctx)
	if !ok {
		return "", nil, status.Error(codes.InvalidArgument, "missing metadata")
	}
	auth := md.Get("authorization")
	if len(auth) == 0 {
		return "", nil, status.Error(codes.Unauthenticated, "missing authorization header")
	}
	if len(auth) > 1 {
		return "", nil, status.Error(codes.InvalidArgument, "multiple authorization headers")
	}
	if len(auth[0]) < 7 || !strings.EqualFold(auth[0][:7], "Bearer ") {
		return "", nil, status.Error(codes.InvalidArgument, "malformed authorization header")
	}
	return auth[0][7:], md, nil
}

func one(md metadata.MD, k string) string {
	if v := md.Get(k); len(v) == 1 {
		return v[0]
	}
	return ""
}

// identity is who a token authenticates (upstream: the OIDC user).
type identity struct {
	kind string // "Exporter" or "Client"
	key  key
}

// authenticate is upstream's VerifyExporterObjectToken/VerifyClientObjectToken
// for kind, with its codes and messages (b1f2bb41, seen live): token
// checks fail with code Unknown, the metadata names the object, the
// object must exist (else Unknown "<kind> ns/name: ... not found") and
// belong to the token (else PermissionDenied).
func (c *Controller) authenticate(ctx context.Context, kind string) (key, error) {
	tok, md, err := bearer(ctx)
	if err != nil {
		return key{}, err
	}
	c.mu.Lock()
	ready := !time.Now().Before(c.authReadyAt)
	var who identity
	known := false
	if k, ok := c.exporterTok[tok]; ok {
		who, known = identity{"Exporter", k}, true
	} else if cl, ok := c.clientTok[tok]; ok {
		who, known = identity{"Client", key{cl.ns, cl.name}}, true
	}
	c.mu.Unlock()
	if !ready {
		return key{}, errors.New("oidc: authenticator not initialized")
	}
	if !known {
		return key{}, errors.New("failed to authenticate token")
	}
	for _, mk := range []string{"jumpstarter-namespace", "jumpstarter-kind"} {
		switch n := len(md.Get(mk)); {
		case n == 0:
			return key{}, status.Errorf(codes.InvalidArgument, "missing metadata: %s", mk)
		case n > 1:
			return key{}, status.Errorf(codes.InvalidArgument, "multiple metadata: %s", mk)
		}
	}
	want := key{one(md, "jumpstarter-namespace"), one(md, "jumpstarter-name")}
	if want.name == "" {
		return key{}, status.Error(codes.InvalidArgument, "resource name required for pre-existing authentication")
	}
	if one(md, "jumpstarter-kind") != kind {
		return key{}, status.Error(codes.InvalidArgument, "object kind mismatch")
	}
	c.mu.Lock()
	exists := false
	if kind == "Exporter" {
		_, exists = c.exporters[want]
	} else {
		for _, cl := range c.clientTok {
			if cl.ns == want.ns && cl.name == want.name {
				exists = true
				break
			}
		}
	}
	c.mu.Unlock()
	lower := strings.ToLower(kind)
	if !exists {
		return key{}, fmt.Errorf("%s %s/%s: %w", lower, want.ns, want.name, notFound(lower+"s", want.name))
	}
	if who != (identity{kind, want}) {
		return key{}, status.Errorf(codes.PermissionDenied, "permission denied for %s %s/%s", lower, want.ns, want.name)
	}
	return want, nil
}

// authExporter returns the exporter a call comes from (c.mu not held).
func (c *Controller) authExporter(ctx context.Context) (key, error) {
	return c.authenticate(ctx, "Exporter")
}

func (c *Controller) authClient(ctx context.Context) (clientRec, error) {
	k, err := c.authenticate(ctx, "Client")
	if err != nil {
		return clientRec{}, err
	}
	return clientRec{k.ns, k.name}, nil
}

// withExporter runs f on the exporter's record under c.mu; NotFound when
// it was deleted meanwhile.
func (c *Controller) withExporter(k key, f func(r *exporterRec)) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.exporters[k]
	if !ok {
		return status.Errorf(codes.NotFound, "exporter %s/%s not found", k.ns, k.name)
	}
	f(r)
	c.notifyLocked()
	return nil
}
