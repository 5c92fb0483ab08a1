package jumpstarter

import (
	"context"
	"fmt"
	"net"
)

// RegistryCredentials are the registry username and password a client
// passes to one flash_oci call (upstream's oci_username, oci_password).
// They are for that pull only: never stored, never logged. String and
// GoString hide the password, so a stray %v cannot print it.
type RegistryCredentials struct {
	Username string
	Password string
}

func (c RegistryCredentials) String() string {
	return fmt.Sprintf("{Username:%s Password:<redacted>}", c.Username)
}

// GoString hides the password from %#v.
func (c RegistryCredentials) GoString() string { return c.String() }

// OCIFlash is one flash_oci call as the target gets it.
type OCIFlash struct {
	// Ref is the image reference (no oci:// prefix).
	Ref string
	// Partition is where the image's disk goes (one of Partitions).
	Partition string
	// Credentials are the call's own (nil: an anonymous pull).
	Credentials *RegistryCredentials
	// Dial makes every connection of the pull to the image's registry,
	// refusing at dial time the addresses the node's fetch policy refuses
	// (nil: the policy is lifted, ResourceOptions.AllowLocalFetch).
	Dial Dialer
}

// Dialer makes connections (net.Dialer's DialContext, or one that refuses
// some addresses).
type Dialer interface {
	DialContext(ctx context.Context, network, addr string) (net.Conn, error)
}

// OCIFlasher is a Target that pulls flash_oci images for a lease onto
// any partition, with the call's credentials and dialler. A target that is
// no OCIFlasher gets flash_oci of root without credentials as
// Target.Flash, and refuses the rest.
type OCIFlasher interface {
	FlashOCI(ctx context.Context, f OCIFlash, progress func(line string)) error
}

// flashCredentials reads flash_oci's oci_username and oci_password
// arguments (positions 2 and 3; null or absent for none). Both or neither
// must be given, as a registry login needs both.
func flashCredentials(args []any) (*RegistryCredentials, error) {
	u, p := arg(args, 2), arg(args, 3)
	if (u == nil || u == "") && (p == nil || p == "") {
		return nil, nil
	}
	us, uok := u.(string)
	ps, pok := p.(string)
	if !uok || !pok || us == "" || ps == "" {
		// Never describe the values: one of them is a password.
		return nil, fmt.Errorf("%w: flash_oci: oci_username and oci_password must both be non-empty strings (or both omitted)", ErrInvalidArgument)
	}
	return &RegistryCredentials{Username: us, Password: ps}, nil
}

// ociFlash is how flash_oci runs f on this exporter's target: FlashOCI
// with the node's fetch policy as f.Dial (checked at every dial, after a
// first check of the registry's name: plain HTTP, where it resolves), or,
// for a target that is no OCIFlasher, Target.Flash for root without
// credentials.
func (e *Exporter) ociFlash(ctx context.Context, f OCIFlash) (func(ctx context.Context, progress func(string)) error, error) {
	of, ok := e.cfg.Target.(OCIFlasher)
	switch {
	case !ok && f.Credentials != nil:
		return nil, fmt.Errorf("%w: registry credentials in the call are not supported by this target", ErrInvalidArgument)
	case !ok && f.Partition != PartitionRoot:
		return nil, fmt.Errorf("%w: this target takes flash_oci onto partition %s only", ErrUnsupported, PartitionRoot)
	}
	if opts := e.cfg.Resources; !opts.AllowLocalFetch {
		if err := opts.Fetch.CheckRegistry(ctx, f.Ref); err != nil { // fetchpolicy.go
			return nil, fmt.Errorf("flash_oci %s: %w", f.Ref, err)
		}
		f.Dial = opts.Fetch.Dialer()
	}
	if ok {
		return func(ctx context.Context, progress func(string)) error { return of.FlashOCI(ctx, f, progress) }, nil
	}
	return func(ctx context.Context, progress func(string)) error {
		return e.cfg.Target.Flash(ctx, f.Ref, progress)
	}, nil
}
