package jumpstarter

import (
	"context"
	"fmt"
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

// CredentialFlasher is a Target that can pull a flash_oci image with the
// call's registry credentials. A target that is no CredentialFlasher
// refuses credentials in the call (InvalidArgument).
type CredentialFlasher interface {
	// FlashWithCredentials is Target.Flash pulling with creds (for this
	// pull only; the target keeps them nowhere).
	FlashWithCredentials(ctx context.Context, ref string, creds RegistryCredentials, progress func(line string)) error
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
